"""``rlcli new judger NAME`` / ``rlcli new agent-loop NAME``: write a plugin package to start from.

The package (default folder ``./rlcli-NAME``) holds a ``pyproject.toml`` that declares the entry
point in the ``rlcli`` group, a module with a working component and its hook, tests that run the
component's kit from :mod:`rlcli.testing`, a README, and a recipe on the quickstart's toy task
(with its data) that uses the component and trains in seconds on the CPU.

What is guaranteed: the files are written only into a folder that does not exist yet or is
empty, each created new (never replacing a file); nothing is ever deleted. The templates are the
strings of :mod:`rlcli.scaffold.templates`, :mod:`rlcli.scaffold.judger` and
:mod:`rlcli.scaffold.agent_loop`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from rlcli.scaffold import agent_loop, judger, templates


class ScaffoldError(Exception):
    """A ``rlcli new`` request that cannot be carried out (bad name, folder in use); exit code 2."""


KINDS = {"judger": judger.TEMPLATE, "agent-loop": agent_loop.TEMPLATE}
"""``rlcli new`` kind -> its :class:`~rlcli.scaffold.templates.KindTemplate`."""

_NAME = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)*")


@dataclass(frozen=True)
class Names:
    """The names one NAME gives a package: component ``name`` (recipes), ``dist`` (pip),
    ``module`` (import) and ``cls`` (the prefix of the class names)."""

    name: str
    dist: str
    module: str
    cls: str

    @classmethod
    def parse(cls, raw: str) -> Names:
        """Normalise ``raw`` (dashes become underscores, a leading ``rlcli-`` is dropped) or raise
        :class:`ScaffoldError` saying what a NAME may hold."""
        name = raw.strip().replace("-", "_")
        name = name.removeprefix("rlcli_")
        if not _NAME.fullmatch(name):
            raise ScaffoldError(
                f"invalid NAME {raw!r}: use lower-case letters and digits, starting with a letter, words "
                f"separated by single '-' or '_' (e.g. 'my-judger'); it becomes the component's name in recipes "
                f"(my_judger), the distribution (rlcli-my-judger) and the module (rlcli_my_judger)")
        return cls(name, "rlcli-" + name.replace("_", "-"), "rlcli_" + name,
                   "".join(part.capitalize() for part in name.split("_")))


def render(text: str, values: dict[str, str]) -> str:
    """``text`` with each ``{{key}}`` replaced by ``values[key]`` (an unknown key is a bug: KeyError)."""
    return re.sub(r"\{\{(\w+)\}\}", lambda m: values[m.group(1)], text)


def package_files(kind: str, names: Names) -> dict[str, str]:
    """Relative path -> text of every file of the package of ``kind`` named ``names``."""
    tpl = KINDS[kind]
    cls = names.cls if names.cls.endswith(tpl.class_suffix) else names.cls + tpl.class_suffix
    values = {"name": names.name, "dist": names.dist, "module": names.module, "Cls": names.cls,
              "Class": cls, "kind": kind, "kind_title": tpl.title, "hook": tpl.hook}
    parts = {"tokenizer": tpl.tokenizer, "recipe_task": tpl.recipe_task, "recipe_eval_task": tpl.recipe_eval_task,
             "readme_yaml": tpl.readme_yaml, "readme_text": tpl.readme_text}
    values.update({key: render(text, values) for key, text in parts.items()})
    files = {
        "pyproject.toml": templates.PYPROJECT,
        "README.md": templates.README,
        ".gitignore": templates.GITIGNORE,
        f"{names.module}/__init__.py": tpl.module,
        f"tests/test_{names.name}.py": tpl.tests,
        f"recipes/{names.name}.yaml": templates.RECIPE,
    }
    out = {path: render(text, values) for path, text in files.items()}
    out["recipes/data/arith.jsonl"] = _arith_jsonl()
    return out


def _arith_jsonl() -> str:
    from rlcli.data.arith import arith_rows

    return "".join(json.dumps(row) + "\n" for row in arith_rows())


def _check_name_free(kind: str, names: Names) -> None:
    """Refuse a NAME already registered for this kind (the plugin would clash with it)."""
    from rlcli.plugins import PluginError, get_registry

    reg_kind = KINDS[kind].registry_kind
    try:
        taken = get_registry().entries[reg_kind].get(names.name)
    except PluginError:  # installed plugins that clash already: not ours to report here
        return
    if taken is not None:
        raise ScaffoldError(f"{reg_kind} {names.name!r} already exists (from {taken.dist} {taken.version}): a "
                            f"plugin registering it again would clash; pick another NAME (`rlcli plugins` lists "
                            f"the names in use)")


def _check_target(root: Path) -> None:
    if root.exists() and not root.is_dir():
        raise ScaffoldError(f"{root} exists and is not a folder; pick another with --dir")
    if root.is_dir() and any(root.iterdir()):
        raise ScaffoldError(f"{root} exists and is not empty; rlcli new writes only into a new or empty folder "
                            f"(pick another with --dir)")


def write_package(kind: str, name: str, target: str | Path | None = None) -> tuple[Path, list[Path]]:
    """Write the package of ``kind`` ('judger' or 'agent-loop') for ``name`` into ``target``
    (default ``./rlcli-NAME``); return the folder and the files written. Raises
    :class:`ScaffoldError` for a bad name, a name already taken or a folder in use."""
    if kind not in KINDS:
        raise ScaffoldError(f"unknown kind {kind!r}; available: {', '.join(KINDS)}")
    names = Names.parse(name)
    _check_name_free(kind, names)
    root = Path(target) if target is not None else Path(names.dist)
    _check_target(root)
    written = []
    try:
        for rel, text in package_files(kind, names).items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("x", encoding="utf-8") as f:  # "x": never replaces a file
                f.write(text)
            written.append(path)
    except OSError as exc:
        raise ScaffoldError(f"cannot write {getattr(exc, 'filename', None) or root}: {exc.strerror or exc} "
                            f"({len(written)} files written before)") from exc
    return root, written


__all__ = ["KINDS", "Names", "ScaffoldError", "package_files", "render", "write_package"]
