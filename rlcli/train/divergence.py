"""A run that diverged never writes its weights: the finite-weights check of the train worker.

A non-finite loss or gradient norm skips its update (``train/skipped_steps``), so the weights
stay finite through a bad batch. An update with a finite gradient can still make them non-finite
(a learning rate far too large): then every later loss is NaN and every step is skipped, while
checkpoints and HF exports would save the ruined weights. :func:`check_finite` runs before each
checkpoint and export, and after a step that skipped an update; it raises
:class:`DivergedError`, on every rank at once, so the run stops with its last good checkpoint
intact.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class DivergedError(RuntimeError):
    """The weights hold NaN or inf values: the run diverged; nothing of them is written."""


def weights_finite(params: Iterable[torch.Tensor], group=None, device: torch.device | None = None) -> bool:
    """Whether every parameter is finite on every rank of ``group`` (collective when it has several)."""
    flags = [torch.isfinite(local.detach()).all()
             for local in (p.to_local() if hasattr(p, "to_local") else p for p in params)  # FSDP2: this rank's shard
             if local.numel()]
    # one flag on the device, read once (not a host sync per parameter)
    flag = (torch.stack(flags).all() if flags else torch.tensor(True)).to(device or "cpu", torch.float32).reshape(1)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item() == 1.0)


def check_finite(params: Iterable[torch.Tensor], when: str, steps_done: int, group=None,
                 device: torch.device | None = None) -> None:
    """Raise :class:`DivergedError` naming ``when`` if a weight is NaN or inf (collective)."""
    if not weights_finite(params, group, device):
        raise DivergedError(
            f"the weights hold NaN or inf values by optimizer step {steps_done}, {when}: the run diverged "
            "(an update with a finite gradient made them non-finite, e.g. a learning rate far too large); "
            "nothing of them is written: resume from the last checkpoint with a lower "
            "train_worker.optimizer.lr or a tighter train_worker.max_grad_norm")
