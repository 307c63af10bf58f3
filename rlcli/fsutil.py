"""Atomic directory publication: build in ``<dest>.tmp``, then swap it in with renames."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


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
