"""Atomic writes: a JSONL file through ``<name>.tmp``; a directory built in ``<dest>.tmp``, then swapped in
(and the recovery of what a process killed in the middle left behind)."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path


def write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    """Write ``rows`` as JSON lines to ``path`` (parents created), through a temporary file and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, default=str) + "\n")
    os.replace(tmp, path)
    return path


def publish_dir(tmp: str | Path, dest: str | Path) -> Path:
    """Replace ``dest`` by the finished ``tmp`` directory.

    An existing ``dest`` is first renamed to ``<dest>.old`` (and removed afterwards), so at every
    moment either the old or the new complete directory exists under a known name; a crash
    never leaves a half-written ``dest``.
    """
    tmp, dest = Path(tmp), Path(dest)
    old = dest.with_name(dest.name + ".old")
    if dest.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


_STEP = re.compile(r"^step-\d+$")


def clean_interrupted(root: str | Path, complete: Callable[[Path], bool]) -> list[Path]:
    """Undo what a killed :func:`publish_dir` left among the ``step-N`` directories of ``root``: remove
    every ``step-N.tmp`` (never published), restore a ``step-N.old`` whose ``step-N`` is gone (when
    ``complete``), remove the other ``.old``. Only these names are touched; returns the removed paths."""
    root = Path(root)
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for p in sorted(root.iterdir()):
        if not (p.name.endswith((".tmp", ".old")) and _STEP.match(p.name[:-4])):
            continue
        final = p.with_name(p.name[:-4])
        if p.name.endswith(".old") and not final.exists() and complete(p):
            os.replace(p, final)
        else:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed
