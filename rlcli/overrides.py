"""Command-line overrides: ``a.b.c=VALUE`` (VALUE parsed as YAML) and ``~a.b.c`` (delete).

Integer path segments index lists (``tasks.0.judger.name=gsm8k``); an index equal to the
list's length appends. Missing intermediate mappings are created.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import yaml


_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def parse_value(text: str) -> Any:
    """YAML, plus exponent floats without a dot (``1e-6``), which YAML 1.1 reads as strings."""
    value = yaml.safe_load(text) if text.strip() else None
    if isinstance(value, str) and _FLOAT.match(value.strip()):
        return float(value)
    return value


class OverrideError(Exception):
    def __init__(self, path: str, message: str):
        self.path, self.message = path, message
        super().__init__(f"{path}: {message}")


def _parse_path(key: str) -> list[str | int]:
    if not key or any(not p for p in key.split(".")):
        raise OverrideError(key or "<empty>", "override keys are dotted paths like trainer.seed")
    return [int(p) if p.lstrip("-").isdigit() else p for p in key.split(".")]


def _descend(node: Any, part: str | int, full: str, create: bool) -> Any:
    if isinstance(node, list):
        if not isinstance(part, int):
            raise OverrideError(full, f"{part!r} indexes a list; use an integer index")
        if not -len(node) <= part < len(node):
            raise OverrideError(full, f"index {part} out of range (list has {len(node)} items)")
        return node[part]
    if isinstance(node, dict):
        if part not in node or node[part] is None:
            if not create:
                raise OverrideError(full, f"key {part!r} not found")
            node[part] = {}
        return node[part]
    raise OverrideError(full, f"cannot descend into {type(node).__name__} at {part!r}")


def apply_overrides(data: Any, overrides: list[str]) -> Any:
    data = copy.deepcopy(data) if data is not None else {}
    for ov in overrides:
        if ov.startswith("~"):
            parts = _parse_path(ov[1:])
            node = data
            for p in parts[:-1]:
                node = _descend(node, p, ov[1:], create=False)
            last = parts[-1]
            if isinstance(node, list) and isinstance(last, int) and -len(node) <= last < len(node):
                del node[last]
            elif isinstance(node, dict) and last in node:
                del node[last]
            else:
                raise OverrideError(ov[1:], "cannot delete: key not found")
            continue
        if "=" not in ov:
            raise OverrideError(ov, "overrides look like key=value or ~key")
        key, _, text = ov.partition("=")
        parts = _parse_path(key.strip())
        try:
            value = parse_value(text)
        except yaml.YAMLError as exc:
            raise OverrideError(key, f"value {text!r} is not valid YAML: {exc}") from None
        except RecursionError:
            raise OverrideError(key, "the value nests too deeply (mappings and lists inside each other)") from None
        node = data
        for p in parts[:-1]:
            node = _descend(node, p, key, create=True)
        last = parts[-1]
        if isinstance(node, list):
            if not isinstance(last, int):
                raise OverrideError(key, f"{last!r} indexes a list; use an integer index")
            if last == len(node):
                node.append(value)
            elif -len(node) <= last < len(node):
                node[last] = value
            else:
                raise OverrideError(key, f"index {last} out of range (list has {len(node)} items)")
        elif isinstance(node, dict):
            node[last] = value
        else:
            raise OverrideError(key, f"cannot set a key inside {type(node).__name__}")
    return data
