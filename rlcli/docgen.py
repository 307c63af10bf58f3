"""Generate the recipe reference (docs/recipes.md) from the pydantic models, so it cannot go stale.

    python -m rlcli.docgen > /tmp/ref.md   # or: python -m rlcli.docgen --write docs/recipes.md
"""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import BaseModel

BEGIN, END = "<!-- BEGIN GENERATED REFERENCE -->", "<!-- END GENERATED REFERENCE -->"


def _default(f) -> str:
    if f.is_required():
        return "**required**"
    if f.default_factory is not None:
        try:
            v = f.default_factory()
        except TypeError:
            return ""
        if isinstance(v, BaseModel):
            return "see below"
        if isinstance(v, list) and v and isinstance(v[0], BaseModel):
            return ", ".join(getattr(x, "name", "") for x in v)
        return f"`{v!r}`"
    return f"`{f.default!r}`"


def _type(f) -> str:
    from rlcli.config import ComponentSpec, _kind_of, _unwrap

    kind = _kind_of(f)
    if kind:
        inner, is_list = _unwrap(f.annotation)
        return f"list of {kind}" if is_list else kind
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
    name = getattr(ann, "__name__", None) or str(ann).replace("typing.", "")
    if isinstance(ann, type) and issubclass(ann, ComponentSpec):
        return "component"
    return name.replace("NoneType", "None")


def model_table(model: type[BaseModel]) -> str:
    lines = ["| field | type | default | description |", "| --- | --- | --- | --- |"]
    for name, f in model.model_fields.items():
        desc = (f.description or "").replace("|", "\\|")
        lines.append(f"| `{name}` | {_type(f).replace('|', 'or')} | {_default(f)} | {desc} |")
    return "\n".join(lines)


def recipe_reference() -> str:
    from rlcli import config as c
    from rlcli.plugins import KINDS, get_registry
    from rlcli.types import SampleParams

    sections = [
        ("model", c.ModelConfig), ("model.from_scratch", c.FromScratch), ("trainer", c.TrainerConfig),
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
    out.append(END)
    return "\n".join(out)


def splice(doc: str, generated: str) -> str:
    head, _, rest = doc.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return head + generated + tail


def main() -> None:
    ref = recipe_reference()
    if len(sys.argv) > 2 and sys.argv[1] == "--write":
        p = Path(sys.argv[2])
        p.write_text(splice(p.read_text(), ref))
    else:
        print(ref)


if __name__ == "__main__":
    main()
