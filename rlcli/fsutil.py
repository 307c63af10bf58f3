"""Atomic writes: a file through a temporary file of its own beside it (``.<name>.<random>.tmp``,
created new, so never a file or link that was already there); a directory built in ``<dest>.tmp``,
then swapped in (and the recovery of what a process killed in the middle left behind).

A write that fails (a full disk, a read-only directory) raises :class:`WriteError`, whose message
names the path and the cause.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path


def _read_umask() -> int:
    """The process's umask (what a plain open() takes off a new file's mode), read without changing
    it where Linux shows it; elsewhere set and restored once, at import."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


_UMASK = _read_umask()

_HINTS = {
    errno.ENOSPC: "free space on that disk, or write somewhere else (--work-dir, --out-dir), and run again",
    errno.EDQUOT: "your disk quota is used up; free space, or write somewhere else, and run again",
}


class WriteError(OSError):
    """Writing ``path`` failed; ``errno`` is the cause's, the message names the path, the cause and a fix."""

    def __init__(self, path: str | Path, cause: OSError, note: str = ""):
        reason = cause.strerror or str(cause)
        hint = _HINTS.get(cause.errno)
        message = f"cannot write {path}: {reason}" + (f"; {hint}" if hint else "") + (f". {note}" if note else "")
        super().__init__(cause.errno, message, str(path))
        self.path, self.cause, self.note = Path(path), cause, note

    def __reduce__(self):
        return type(self), (self.path, self.cause, self.note)

    def __str__(self) -> str:
        return self.strerror


FULL_DISK_BYTES = 1 << 20


def write_failure(path: str | Path, exc: BaseException, causes: Iterable[BaseException] = ()) -> WriteError | None:
    """``exc``, raised while writing ``path``, as a :class:`WriteError` naming ``path``, or None when
    it is not a failed write. The cause is the first OSError among ``exc`` and ``causes``; libraries
    that lose it (torch's zip writer reports ``unexpected pos``, safetensors its own error) leave
    none, and then a device with less than :data:`FULL_DISK_BYTES` free is taken as full."""
    cause = next((e for e in (exc, *causes) if isinstance(e, OSError)), None)
    if isinstance(cause, WriteError):
        return cause
    if cause is None:
        try:
            full = shutil.disk_usage(Path(path).parent).free < FULL_DISK_BYTES
        except OSError:
            full = False
        if not full:
            return None
        cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return WriteError(path, cause)


def new_tmp(path: str | Path) -> Path:
    """Create (exclusively: no existing file or link is opened) an empty temporary file for ``path``
    in its directory, ``.<name>.<random>.tmp``, with the mode a new file would get."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
    finally:
        os.close(fd)
    return Path(name)


def replace_via_tmp(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Have ``write(tmp)`` fill a fresh temporary file (:func:`new_tmp`), then rename it over ``path``;
    on any failure the temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    tmp = None
    try:
        tmp = new_tmp(path)
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` (parents created) through a temporary file and a rename."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_via_tmp(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    except OSError as exc:
        raise WriteError(path, exc) from None
    return path


def write_jsonl(path: str | Path, rows: list[dict]) -> Path:
    """Write ``rows`` as JSON lines to ``path``, as :func:`write_text`."""
    return write_text(path, "".join(json.dumps(r, default=str) + "\n" for r in rows))


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
