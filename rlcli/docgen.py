"""Generate the docs that list what the code declares, so they cannot go stale: the recipe
reference of docs/recipes.md (from the pydantic models) and the kind table of docs/plugins.md
(from rlcli.hookspecs.COMPONENT_KINDS, the recipe models and the built-in registrations).

    python -m rlcli.docgen > /tmp/ref.md   # the recipe reference
    RLCLI_DISABLE_PLUGIN_AUTOLOAD=1 python -m rlcli.docgen --write docs/recipes.md docs/plugins.md
"""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import BaseModel

BEGIN, END = "<!-- BEGIN GENERATED REFERENCE -->", "<!-- END GENERATED REFERENCE -->"
KINDS_BEGIN, KINDS_END = "<!-- BEGIN GENERATED KIND TABLE -->", "<!-- END GENERATED KIND TABLE -->"


def _default(f) -> str:
    if f.is_required():
        return "**required**"
    if f.default_factory is not None:
        try:
            v = f.default_factory()
        except TypeError:
            return ""
        if isinstance(v, BaseModel):
            return f"`{{name: {v.name}}}`, see below" if _choice_models(f) else "see below"
        if isinstance(v, list) and v and isinstance(v[0], BaseModel):
            return ", ".join(getattr(x, "name", "") for x in v)
        return f"`{v!r}`"
    return f"`{f.default!r}`"


def _choice_models(f) -> list[type[BaseModel]]:
    """The option models of a field that is a fixed choice among models told apart by ``name``
    (e.g. a multi-turn loop's ``tool_format``), or [] for any other field."""
    import typing

    args = [a for a in typing.get_args(f.annotation) if a is not type(None)]
    if len(args) < 2 or not all(isinstance(a, type) and issubclass(a, BaseModel) and "name" in a.model_fields
                                for a in args):
        return []
    return args


def _choice_name(model: type[BaseModel]) -> str:
    return str(model.model_fields["name"].default)


def _type(f) -> str:
    from rlcli.config import ComponentSpec, _kind_of, _unwrap

    if _choice_models(f):
        return "one of " + ", ".join(f"`{{name: {_choice_name(m)}}}`" for m in _choice_models(f))

    kind = _kind_of(f)
    if kind:
        inner, is_list = _unwrap(f.annotation)
        return f"list of {kind}" if is_list else kind
    import types
    import typing

    ann = f.annotation
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    if typing.get_origin(ann) is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in typing.get_args(ann))
    if len(args) == 1 and typing.get_origin(args[0]) is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in typing.get_args(args[0])) + ", or null"
    if len(args) == 1 and len(typing.get_args(ann)) == 2:
        inner = getattr(args[0], "__name__", str(args[0]))
        return f"{inner} or null"
    scalar_or_literal = all(a in (int, float, str, bool) or typing.get_origin(a) is typing.Literal for a in args)
    if typing.get_origin(ann) in (typing.Union, types.UnionType) and len(args) > 1 and scalar_or_literal:
        parts = [", ".join(f"`{v}`" for v in typing.get_args(a)) if typing.get_origin(a) is typing.Literal
                 else a.__name__ for a in args]  # float | Literal['positive'] -> float or `positive`
        return " or ".join(parts) + (" or null" if len(args) < len(typing.get_args(ann)) else "")
    name = getattr(ann, "__name__", None) or str(ann).replace("typing.", "")
    if isinstance(ann, type) and issubclass(ann, ComponentSpec):
        return "component"
    return name.replace("NoneType", "None")


def model_table(model: type[BaseModel]) -> str:
    lines = ["| field | type | default | description |", "| --- | --- | --- | --- |"]
    for name, f in model.model_fields.items():
        desc = (f.description or "").replace("|", "\\|")
        default = _default(f).replace("|", "\\|")
        lines.append(f"| `{name}` | {_type(f).replace('|', 'or')} | {default} | {desc} |")
    return "\n".join(lines)


def recipe_reference() -> str:
    from rlcli import config as c
    from rlcli.plugins import KINDS, get_registry
    from rlcli.types import SampleParams

    sections = [
        ("model", c.ModelConfig), ("model.from_scratch", c.FromScratch), ("model.lora", c.LoraConfig),
        ("trainer", c.TrainerConfig),
        ("resources", c.ResourcesConfig), ("train_worker", c.TrainWorkerConfig),
        ("train_worker.optimizer", c.OptimizerConfig), ("train_worker.lr_scheduler", c.LRSchedulerConfig),
        ("train_worker.fsdp", c.FSDPConfig), ("train_worker.kl", c.KLConfig),
        ("train_worker.rollout_is", c.RolloutISConfig), ("tasks[]", c.TaskConfig), ("eval", c.EvalConfig),
        ("eval.evaluator", c.EvaluatorConfig), ("sample_params (of agent loops)", SampleParams),
    ]
    out = [BEGIN, "", "## Sections", ""]
    for title, model in sections:
        out += [f"### `{title}`", "", model_table(model), ""]
    out += ["## Built-in components", "",
            "Options of each registered component (third-party plugins: `rlcli plugins`).", ""]
    reg = get_registry()
    for kind in KINDS:
        for name in reg.names(kind):
            e = reg.entry(kind, name)
            if e.dist != "rlcli":
                continue
            out += [f"### {kind} `{name}`", "", e.description, ""]
            out += [model_table(e.cls.Config) if e.cls.Config.model_fields else "(no options)", ""]
            out += _choice_tables(e.cls.Config, f"{kind} `{name}`")
    out.append(END)
    return "\n".join(out)


def _choice_tables(model: type[BaseModel], owner: str) -> list[str]:
    """A table for each option of each fixed-choice field of ``model``."""
    out = []
    for field_name, f in model.model_fields.items():
        for choice in _choice_models(f):
            out += [f"#### {owner}: `{field_name}` `{{name: {_choice_name(choice)}}}`", "",
                    " ".join((choice.__doc__ or "").split()), "", model_table(choice), ""]
    return out


def _builtin_entries(reg, kind: str) -> list:
    return [reg.entry(kind, name) for name in reg.names(kind) if reg.entry(kind, name).dist == "rlcli"]


def recipe_keys(reg) -> dict[str, list[str]]:
    """kind -> where recipes configure it: the recipe's component fields, and those in the options
    of a built-in component (the ``multi_turn`` agent loop's ``tools``)."""
    from rlcli.config import Recipe
    from rlcli.config.tree import component_fields

    keys: dict[str, list[str]] = {}
    for path, kind in component_fields(Recipe):
        keys.setdefault(kind, []).append(f"`{path}`")
        for e in _builtin_entries(reg, kind):
            for sub_path, sub_kind in component_fields(e.cls.Config, path + "."):
                keys.setdefault(sub_kind, []).append(f"`{sub_path}` ({kind} `{e.name}`)")
    return keys


def kind_table() -> str:
    """The table of component kinds of docs/plugins.md, one row per declared kind, in order."""
    from rlcli.hookspecs import COMPONENT_KINDS
    from rlcli.plugins import get_registry

    reg = get_registry()
    keys = recipe_keys(reg)
    lines = [KINDS_BEGIN, "", "| kind | hook | base class (the contract) | recipe keys | built-ins |",
             "| --- | --- | --- | --- | --- |"]
    for k in COMPONENT_KINDS:
        builtins = ", ".join(f"`{e.name}`" for e in _builtin_entries(reg, k.name))
        lines.append(f"| `{k.name}` | `{k.hook}` | `{k.base}` | {', '.join(keys.get(k.name, []))} | {builtins} |")
    lines += ["", KINDS_END]
    return "\n".join(lines)


def splice(doc: str, generated: str) -> str:
    """Replace the block of ``doc`` between the generated block's first and last lines (its markers)."""
    lines = generated.splitlines()
    head, _, rest = doc.partition(lines[0])
    _, _, tail = rest.partition(lines[-1])
    return head + generated + tail


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--write":
        for path in sys.argv[2:]:
            p = Path(path)
            text = p.read_text()
            for begin, generate in ((BEGIN, recipe_reference), (KINDS_BEGIN, kind_table)):
                if begin in text:
                    text = splice(text, generate())
            p.write_text(text)
    else:
        print(recipe_reference())


if __name__ == "__main__":
    main()
