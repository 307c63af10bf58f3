"""Atomic writes: a JSONL file through ``<name>.tmp``; a directory built in ``<dest>.tmp``, then swapped in."""

from __future__ import annotations

import json
import os
import shutil
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
