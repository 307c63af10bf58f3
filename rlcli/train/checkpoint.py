"""Training checkpoints: DCP model/optimizer shards plus everything needed for an exact resume.

Layout of ``<root>/step-N/``::

    weights/           torch.distributed.checkpoint (DCP) of {"model": ..., "optim": ...}; every rank writes its shards
    rank-<r>.pt        per-rank state: LR scheduler, RNG states (python, numpy, torch CPU, CUDA)
    extra_state.pt     the caller's dict (sampler positions, replay buffer, step, ...), from rank 0
    meta.json          format version, world size, whether the optimizer is included
    COMPLETE           written last

Saving is atomic: everything goes to ``step-N.tmp`` and is renamed to ``step-N`` once complete,
so a crash mid-save leaves earlier checkpoints intact and no half-written ``step-N``. Leftover
``.tmp`` directories are never picked up by :func:`latest_checkpoint` and are removed by the
next save (or :func:`clean_incomplete`). A filesystem shared by all ranks is assumed (as DCP
does). A save that fails to write (a full disk) raises :class:`rlcli.fsutil.WriteError` naming the
file, removes its ``.tmp`` directory and leaves the earlier checkpoints as they were.

Loading cannot run code: every file is read as tensors and plain data only, and anything else is
refused with :class:`CheckpointError` (see :mod:`rlcli.train.checkpoint_files`). RNG states are
saved as plain values (numpy's key as a list of ints) for the same reason.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from rlcli.dist import barrier, is_main, rank, world_size
from rlcli.faults import fault_point
from rlcli.fsutil import WriteError, clean_interrupted, publish_dir
from rlcli.train.checkpoint_files import (
    CheckpointError,
    load_pt,
    load_weights,
    save_pt,
    save_weights,
    write_bytes,
)
from rlcli.train.lora import check_meta

FORMAT_VERSION = 1
COMPLETE = "COMPLETE"
_STEP_RE = re.compile(r"^step-(\d+)$")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step}"


def is_complete(path: str | Path) -> bool:
    return (Path(path) / COMPLETE).is_file()


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete ``step-N`` checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete ``step-N`` directory with the highest N, or None."""
    ckpts = list_checkpoints(root)
    return ckpts[-1][1] if ckpts else None


def prune(root: str | Path, maxkeep: int | None) -> list[Path]:
    """Delete all but the newest ``maxkeep`` complete checkpoints (None, -1 or 0: keep all); rank 0 only.
    The ``COMPLETE`` marker goes first, so a process killed mid-way never leaves a partial checkpoint
    that looks complete; a ``step-N`` that is a link is left alone (rlcli did not make it)."""
    if maxkeep is None or maxkeep <= 0 or not is_main():
        return []
    ckpts = [(s, p) for s, p in list_checkpoints(root) if not p.is_symlink()]
    doomed = [p for _, p in ckpts[: max(0, len(ckpts) - maxkeep)]]
    for p in doomed:
        (p / COMPLETE).unlink(missing_ok=True)
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def clean_incomplete(root: str | Path) -> list[Path]:
    """Remove leftovers of interrupted saves (``*.tmp``); restore a ``step-N.old`` whose ``step-N`` is gone."""
    return clean_interrupted(root, is_complete) if is_main() else []


def _restore_schedule(scheduler, optimizer, state: dict) -> None:
    """Continue the LR schedule at the saved step. The schedule's shape is the recipe's (a resumed run
    whose recipe changed ``lr_scheduler`` or the step count follows the new one), not the one pickled
    into the checkpoint; with an unchanged recipe both give the same learning rates, bit for bit."""
    state = dict(state)
    state["lr_lambdas"] = [None] * len(scheduler.lr_lambdas)  # keep the recipe's schedule objects
    state.pop("base_lrs", None)  # and the recipe's peak learning rates
    scheduler.load_state_dict(state)
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    scheduler._last_lr = lrs
    if optimizer is not None:
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr


# ------------------------------------------------------------------------------------ RNG
def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and (if initialised) CUDA generator states of this process."""
    name, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (name, key.tolist(), int(pos), int(has_gauss), float(cached_gaussian)),  # plain values
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, key, *rest = state["numpy"]  # the key is an ndarray in checkpoints written before issue 28
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------- save / load
def save_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    extra_state: dict[str, Any] | None = None,
    *,
    no_optimizer: bool = False,
    lora: dict[str, Any] | None = None,
) -> Path:
    """Save a checkpoint to ``path`` atomically (collective: call on every rank). Returns ``path``.

    ``model`` must be an FSDP2 module in its sharded state (call ``model.reshard()`` after
    no-grad forwards). An optimizer that has never stepped is not saved (loading then leaves
    the fresh optimizer untouched, which is equivalent). ``lora`` (the adapters' shape, see
    :func:`rlcli.train.lora.checkpoint_meta`): only the trainable parameters are saved (the frozen
    base comes from the model directory) and ``meta.json`` records it.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        _write(path, tmp, model, optimizer, scheduler, extra_state, no_optimizer, lora)
    except WriteError as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # give the space back; earlier checkpoints are untouched
        previous = latest_checkpoint(path.parent)
        kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        raise WriteError(exc.path, exc.cause, f"Checkpoint {path.name} was not saved; {kept}") from None
    return path


def _write(path: Path, tmp: Path, model, optimizer, scheduler, extra_state, no_optimizer: bool,
           lora: dict[str, Any] | None) -> None:
    """The body of :func:`save_checkpoint`: fill ``tmp``, then publish it as ``path``."""
    if is_main():
        with _naming(path.parent):
            path.parent.mkdir(parents=True, exist_ok=True)
            clean_incomplete(path.parent)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
    barrier()

    with_optim = optimizer is not None and not no_optimizer and bool(optimizer.state)
    state = _state(model, optimizer if with_optim else None, lora)
    save_weights(state, tmp / "weights")
    fault_point(f"checkpoint:after_weights:{path.name}")

    rank_state = {"rng": capture_rng_state(), "scheduler": scheduler.state_dict() if scheduler is not None else None}
    save_pt(tmp / f"rank-{rank()}.pt", rank_state)
    if is_main():
        save_pt(tmp / "extra_state.pt", extra_state or {})
        meta = {"format": FORMAT_VERSION, "world_size": world_size(), "has_optimizer": with_optim}
        if lora is not None:
            meta["lora"] = lora
        write_bytes(tmp / "meta.json", (json.dumps(meta, indent=2) + "\n").encode())
    barrier()
    if is_main():
        write_bytes(tmp / COMPLETE, b"")
        with _naming(path):
            publish_dir(tmp, path)
    barrier()


def _options(lora: dict[str, Any] | None) -> StateDictOptions:
    return StateDictOptions(ignore_frozen_params=True, strict=False) if lora is not None else StateDictOptions()


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, lora: dict[str, Any] | None) -> dict:
    """``{"model": ..., "optim": ...}`` as checkpoints hold them (no ``optim`` without ``optimizer``):
    every parameter, or (LoRA) no frozen one (torch's ``ignore_frozen_params`` keeps a frozen tied
    alias such as ``lm_head.weight``: dropped here)."""
    options = _options(lora)
    if optimizer is not None:
        msd, osd = get_state_dict(model, optimizer, options=options)
        state = {"model": msd, "optim": osd}
    else:
        state = {"model": get_model_state_dict(model, options=options)}
    if lora is not None:
        frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        state["model"] = {k: v for k, v in state["model"].items() if k not in frozen}
    return state


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """Turns an OSError inside into a :class:`WriteError` naming ``path``."""
    try:
        yield
    except WriteError:
        raise
    except OSError as exc:
        raise WriteError(path, exc) from None


def read_meta(path: str | Path) -> dict[str, Any]:
    file = Path(path) / "meta.json"
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: cannot be read ({exc})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{file}: holds {type(meta).__name__}, not a JSON object")
    return meta


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    *,
    load_optimizer: bool = True,
    restore_rng: bool = True,
    lora: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Restore a checkpoint written by :func:`save_checkpoint` (collective); returns its ``extra_state``.

    The optimizer is restored when the checkpoint has one and ``load_optimizer`` is True;
    otherwise it is left as is. RNG and scheduler states come from this rank's file, or rank
    0's when the world size changed. ``lora``: the model's adapters (as for :func:`save_checkpoint`);
    a checkpoint written with other adapters, or with or without any, is refused.
    """
    path = Path(path)
    if not is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
    meta = read_meta(path)
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')} is not supported "
                              f"(expected {FORMAT_VERSION})")
    mismatch = check_meta(meta.get("lora"), lora, path)
    if mismatch:
        raise CheckpointError(mismatch)
    with_optim = bool(meta["has_optimizer"]) and load_optimizer and optimizer is not None
    options = _options(lora)
    state = _state(model, optimizer if with_optim else None, lora)
    load_weights(state, path / "weights")
    if with_optim:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=options)
    else:
        set_model_state_dict(model, state["model"], options=options)

    rank_file = path / f"rank-{rank()}.pt"
    if not rank_file.exists() or meta.get("world_size") != world_size():
        rank_file = path / "rank-0.pt"
    rank_state = load_pt(rank_file, legacy_rng=True)
    if scheduler is not None and rank_state.get("scheduler") is not None:
        _restore_schedule(scheduler, optimizer, rank_state["scheduler"])
    if restore_rng:
        restore_rng_state(rank_state["rng"])
    return load_pt(path / "extra_state.pt")
