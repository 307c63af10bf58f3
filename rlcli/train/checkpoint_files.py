"""The files of a checkpoint: read so that loading cannot run code, written so that a failure names its file.

A checkpoint is data that may come from someone else (``rlcli eval --checkpoint DIR``, a work
dir copied from another machine), so nothing in it is unpickled freely:

- ``rank-<r>.pt``, ``extra_state.pt``: ``torch.load(weights_only=True)``, which rebuilds tensors
  and plain containers (dict, list, tuple, str, bytes, numbers, bool, None) and refuses every other
  class or function. Rank files written before issue 28 keep numpy's RNG key as an ndarray; for
  rank files only, numpy's array reconstructor, ``ndarray``, ``dtype`` and the uint32 dtype class
  are allowed too (they rebuild an array of numbers and call nothing else).
- ``weights/.metadata`` (DCP's index, a pickle): an unpickler that resolves only DCP's metadata
  classes, ``torch.Size``, torch dtypes and layouts, and pathlib paths.
- ``weights/*.distcp``: tensors through DCP's own ``torch.load(weights_only=True)``; the optimizer's
  non-tensor entries (param-group hyperparameters) with ``weights_only=True`` as well (DCP's default
  planner would use ``weights_only=False``).

Anything else raises :class:`CheckpointError` naming the file and what was refused, before any of
it is called. Writes go through memory (``torch.save`` to a buffer, then one Python write and an
fsync), so a full disk is reported as ``No space left on device`` with the file's path
(:class:`rlcli.fsutil.WriteError`) rather than torch's ``unexpected pos``.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo

from rlcli.fsutil import WriteError, write_failure

# Below this much free space, a failed write whose error torch swallowed is reported as a full disk.

_reconstruct = (np._core if hasattr(np, "_core") else np.core).multiarray._reconstruct
_LEGACY_RNG_GLOBALS = [
    (_reconstruct, "numpy._core.multiarray._reconstruct"),
    (_reconstruct, "numpy.core.multiarray._reconstruct"),  # the same function, as numpy 1.x named it
    np.ndarray, np.dtype, type(np.dtype(np.uint32)),
]


class CheckpointError(ValueError):
    """A checkpoint that rlcli will not load: unsafe, damaged, or not a checkpoint at all."""


def _refusal(path: Path, reason: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: refused to load: {reason}. rlcli loads only tensors and plain data from a checkpoint, so that "
        f"loading one cannot run code; this file was not written by rlcli, or was altered after. Do not use it")


def _damaged(path: Path, exc: BaseException) -> CheckpointError:
    text = str(exc)
    if "WeightsUnpickler error:" in text:  # torch's advice around it is about trusting the file: drop it
        text = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation", 1)[0]
    reason = ": ".join(x for x in (type(exc).__name__, " ".join(text.split())[:200]) if x)
    return CheckpointError(f"{path}: cannot be read ({reason}); the file is damaged or not part of an rlcli checkpoint")


def _unsafe_globals(file: Path | io.BytesIO, allowed: list) -> str:
    """The globals the pickle in ``file`` names beyond ``allowed`` (read without unpickling); "" if none."""
    try:
        with torch.serialization.safe_globals(allowed):
            return ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(file))
    except Exception:  # noqa: BLE001 - a damaged file: no names to give
        return ""


def load_pt(path: str | Path, *, legacy_rng: bool = False) -> Any:
    """``torch.load(weights_only=True)`` of one ``*.pt`` file; :class:`CheckpointError` if refused or unreadable."""
    path = Path(path)
    allowed = _LEGACY_RNG_GLOBALS if legacy_rng else []
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete") from None
    except Exception as exc:  # noqa: BLE001 - whatever a foreign or damaged file makes torch raise
        names = _unsafe_globals(path, allowed)
        raise (_refusal(path, f"it names {names}") if names else _damaged(path, exc)) from None


# ------------------------------------------------------------------------------ DCP weights
def _torch_dtypes() -> dict[str, Any]:
    return {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}


def _metadata_globals() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {("torch", n): v for n, v in _torch_dtypes().items()}
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[(_StorageInfo.__module__, _StorageInfo.__name__)] = _StorageInfo
    for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                 "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"):
        allowed[("torch.distributed.checkpoint.metadata", name)] = getattr(dcp_metadata, name)
    for module in ("pathlib", "pathlib._local"):  # where PosixPath lives before and since Python 3.13
        for name in ("PosixPath", "PurePosixPath"):
            allowed[(module, name)] = getattr(__import__("pathlib"), name)
    return allowed


class _Refused(pickle.UnpicklingError):
    """A global outside :func:`_metadata_globals` (its ``module.name`` is the message)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the classes DCP's ``.metadata`` is made of; any other global is refused unrun."""

    allowed = _metadata_globals()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise _Refused(f"{module}.{name}") from None


def _read_metadata(path: Path) -> dcp_metadata.Metadata:
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as exc:
        raise _refusal(path, f"it names {exc}") from None
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete") from None
    except Exception as exc:  # noqa: BLE001 - whatever a damaged pickle makes the unpickler raise
        raise _damaged(path, exc) from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class _SafeReader(dcp.FileSystemReader):
    """DCP's file reader, but ``.metadata`` goes through :class:`_MetadataUnpickler`, once.

    :func:`load_weights` reads it before ``dcp.load`` (which would turn a refusal into a fallback
    to per-rank metadata and an AssertionError); DCP then gets the same object.
    """

    def __init__(self, path: Path):
        super().__init__(path)
        self.metadata: dcp_metadata.Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if self.metadata is None:
            self.metadata = _read_metadata(Path(self._get_metadata_path()))
        if getattr(self.metadata, "storage_meta", None) is None:
            self.metadata.storage_meta = dcp_metadata.StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


class _SafePlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor entries are read with ``weights_only=True``."""

    def __init__(self, where: Path):
        super().__init__()
        self._where = where

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - whatever a foreign or damaged entry makes torch raise
            value.seek(0)
            names = _unsafe_globals(value, [])
            entry = f"its entry {read_item.dest_index.fqn!r}"
            raise (_refusal(self._where, f"{entry} names {names}") if names else _damaged(self._where, exc)) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _failures(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, what caused it, and every rank's exception inside a DCP ``CheckpointException``."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            todo += [failure for failure, _ in e.failures.values()]


def load_weights(state: dict[str, Any], path: Path) -> None:
    """``dcp.load`` of ``state`` from ``path`` with the safe reader and planner (collective)."""
    reader = _SafeReader(path)
    reader.read_metadata()  # a refusal surfaces here, as itself
    try:
        dcp.load(state, storage_reader=reader, planner=_SafePlanner(path))
    except CheckpointException as exc:
        refused = next((e for e in _failures(exc) if isinstance(e, CheckpointError)), None)
        if refused is None:
            raise
        raise refused from None


# ------------------------------------------------------------------------------------ writes
def write_bytes(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` and fsync it; an OSError becomes a :class:`WriteError` naming ``path``."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise WriteError(path, exc) from None


def save_pt(path: Path, obj: Any) -> None:
    """``torch.save`` through memory, after checking that :func:`load_pt` will read it back."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    try:
        torch.load(io.BytesIO(buf.getbuffer()), weights_only=True)
    except pickle.UnpicklingError:
        names = _unsafe_globals(io.BytesIO(buf.getbuffer()), []) or "objects of other kinds"
        raise TypeError(f"{path.name}: a checkpoint holds only tensors and plain data (dict, list, tuple, set, str, "
                        f"bytes, numbers, bool, None), so that loading it cannot run code; this state holds "
                        f"{names}") from None
    write_bytes(path, buf.getbuffer())


def save_weights(state: dict[str, Any], path: Path) -> None:
    """``dcp.save``; a failed write becomes a :class:`WriteError` naming ``path``.

    torch's zip writer swallows the OSError of a full disk (it reports ``unexpected pos``);
    :func:`rlcli.fsutil.write_failure` then takes a full device as the cause.
    """
    try:
        dcp.save(state, checkpoint_id=str(path))
    except (CheckpointException, RuntimeError, OSError) as exc:
        failure = write_failure(path, exc, _failures(exc))
        if failure is None:
            raise
        raise failure from None
