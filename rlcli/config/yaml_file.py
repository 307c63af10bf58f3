"""Reading a recipe file: UTF-8 YAML, safe-loaded, with every oddity a clear :class:`RecipeError`.

Refused, each with the line and the fix: a file that is not UTF-8 (UTF-16 and UTF-32 recognised by
their byte-order mark or their NUL bytes), invalid YAML, nesting deeper than
:data:`MAX_DEPTH` levels (checked on the parser's events, before anything is built, so no
recursion limit is ever reached), and a key given twice in one mapping (YAML would silently keep
the last value; both lines are named). A UTF-8 byte-order mark is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rlcli.config.issues import Issue, RecipeError

MAX_DEPTH = 64  # a recipe is about six levels deep
_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
         (b"\xfe\xff", "UTF-16"))


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def decode_recipe(data: bytes) -> str:
    """The text of a recipe file; ``ValueError`` naming the line when it is not UTF-8."""
    for bom, name in _BOMS:
        if data.startswith(bom):
            raise ValueError(f"the file is {name} (it starts with a {name} byte-order mark); save it as UTF-8")
    nul = data.find(b"\x00")
    if nul >= 0:
        raise ValueError(f"line {_line_of(data, nul)}: the file holds NUL bytes (UTF-16 or UTF-32 text, or a binary "
                         "file?); save it as UTF-8 text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"line {_line_of(data, exc.start)}: not valid UTF-8 (byte {data[exc.start]:#04x}: "
                         f"{exc.reason}); save the file as UTF-8") from None


def check_depth(text: str, limit: int = MAX_DEPTH) -> None:
    """``ValueError`` naming the line where mappings and lists nest deeper than ``limit``."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > limit:
                raise ValueError(f"line {event.start_mark.line + 1}: mappings and lists nest more than {limit} levels "
                                 "deep; a recipe needs a handful: look for runaway brackets or indentation")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def _duplicate_keys(root: yaml.Node | None) -> list[Issue]:
    """Every key given twice in one mapping, at its dotted path, naming both lines (``<<`` merges
    are not repeats). Walks the composed nodes without recursion; aliases are visited once."""
    found: list[tuple[int, Issue]] = []
    stack: list[tuple[yaml.Node, tuple]] = [(root, ())] if root is not None else []
    visited: set[int] = set()
    while stack:
        node, path = stack.pop()
        if id(node) in visited:
            continue
        visited.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack += [(v, path + (i,)) for i, v in enumerate(node.value)]
        elif isinstance(node, yaml.MappingNode):
            seen: dict[tuple[str, str], yaml.Mark] = {}
            for k, v in node.value:
                merge = k.tag == "tag:yaml.org,2002:merge"
                key = k.value if isinstance(k, yaml.ScalarNode) else "?"
                if not merge and isinstance(k, yaml.ScalarNode):
                    first, mark = seen.setdefault((k.tag, key), k.start_mark), k.start_mark
                    if first is not mark:
                        found.append((mark.line, Issue(".".join(map(str, path + (key,))),
                                                       f"given twice in one mapping, {_where(first, mark)}; YAML "
                                                       "would silently keep the last value: remove one")))
                stack.append((v, path if merge else path + (key,)))
    return [issue for _, issue in sorted(found, key=lambda f: f[0])]


def _where(first: yaml.Mark, second: yaml.Mark) -> str:
    if first.line == second.line:
        return f"on line {first.line + 1} (columns {first.column + 1} and {second.column + 1})"
    return f"on lines {first.line + 1} and {second.line + 1}"


def load_yaml_text(text: str, source: str | None = None) -> Any:
    """Safe-load ``text``; :class:`RecipeError` listing every key given twice (``source``: the file)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        duplicates = _duplicate_keys(node)
        if duplicates:
            raise RecipeError(duplicates, source)
        return loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()


def read_yaml(path: str | Path) -> Any:
    """The data of a recipe file; :class:`RecipeError` for every problem above."""
    p = Path(path)
    if not p.exists():
        raise RecipeError([Issue("", f"recipe file not found: {p}")], str(p))
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise RecipeError([Issue("", f"cannot read the recipe file: {exc.strerror or exc}")], str(p)) from None
    try:
        text = decode_recipe(data)
        check_depth(text)
        return load_yaml_text(text, str(p))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise RecipeError([Issue("", f"invalid YAML: {where}{getattr(exc, 'problem', exc)}")], str(p)) from None
    except ValueError as exc:
        raise RecipeError([Issue("", str(exc))], str(p)) from None
