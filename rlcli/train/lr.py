"""Learning-rate schedules: linear warmup, then constant, linear or cosine decay to ``min_lr_ratio``.

The schedule is a multiplier of the optimizer's base LR, indexed by the number of optimizer
steps already taken (``step = 0`` is the LR of the first update). The scheduler is stepped once
per optimizer step (``total_steps × optimizer_steps`` in a run), skipped updates included, so a
run's LR only depends on how far it got, and a resumed run continues the same curve.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


class LRSchedule:
    """Callable ``step -> LR multiplier`` (a plain object, so ``LambdaLR`` can save its state)."""

    def __init__(self, name: str, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0):
        if name not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown lr schedule {name!r}; expected constant, linear or cosine")
        if total_steps <= 0:
            raise ValueError(f"total optimizer steps must be positive, got {total_steps}")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        self.name = name
        self.total_steps = total_steps
        self.warmup_steps = max(0, warmup_steps)
        self.min_lr_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.name == "constant":
            return 1.0
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, max(0.0, (step - self.warmup_steps) / decay_steps))
        if self.name == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


def warmup_steps_for(cfg, total_optimizer_steps: int) -> int:
    """``warmup_steps`` if set, else ``round(warmup_ratio × total)``."""
    if cfg.warmup_steps > 0:
        return cfg.warmup_steps
    return int(round(cfg.warmup_ratio * total_optimizer_steps))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg, total_optimizer_steps: int) -> LambdaLR:
    """A ``LambdaLR`` for an :class:`rlcli.config.LRSchedulerConfig` over ``total_optimizer_steps``."""
    schedule = LRSchedule(cfg.name, total_optimizer_steps, warmup_steps_for(cfg, total_optimizer_steps),
                          cfg.min_lr_ratio)
    return LambdaLR(optimizer, schedule)
