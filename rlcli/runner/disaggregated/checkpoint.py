"""A disaggregated run's checkpoints: one job-wide collective save of the train state, every rollout
rank's manager state and every rank's RNG; the checks a resume makes against the placement."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from rlcli.dist import barrier
from rlcli.runner.disaggregated.boot import _Boot
from rlcli.runner.ranks import gather_to_main
from rlcli.runner.transport import Placement
from rlcli.runner.workdir import recipe_record


class _RolloutStub(torch.nn.Module):
    """What a rollout rank brings to the job-wide checkpoint collectives: no model, one scalar buffer
    naming the rank (DCP needs a non-empty state; the name cannot collide with the policy's keys)."""

    def __init__(self, rank: int):
        super().__init__()
        self.register_buffer(f"rollout_rank_{rank}", torch.tensor(rank))


def _checkpoint_dir(boot: _Boot, step: int) -> Path:
    return boot.work_dir / "checkpoints" / f"step-{step}"


def _save_collective(boot: _Boot, step: int, contribution: Any, save: Callable[[Path, Any], Any]) -> None:
    """Every rank: gather the pieces of the extra state on rank 0, then save (DCP is collective)."""
    from rlcli.train.checkpoint import prune

    gathered = gather_to_main(contribution)
    extra = None
    if boot.rank == 0:
        n = len(boot.placement.rollout)
        managers: list[Any] = [None] * n
        train_step = None
        for part in gathered:
            if part and part["role"] == "rollout":
                managers[part["index"]] = part["manager"]
            elif part and part["role"] == "train":
                train_step = part["step"]
        if train_step != step or any(m is None for m in managers):
            raise RuntimeError(f"checkpoint step {step}: incomplete state from the ranks (train step {train_step}, "
                               f"{sum(m is not None for m in managers)}/{n} rollout managers)")
        extra = {"step": step, "mode": "disaggregated", "placement": boot.placement.as_dict(), "managers": managers,
                 "recipe": recipe_record(boot.recipe)}
    save(_checkpoint_dir(boot, step), extra)
    prune(boot.work_dir / "checkpoints", boot.recipe.trainer.checkpoint_maxkeep)  # rank 0 only
    barrier()


def _check_extra(extra: dict, placement: Placement, path: Path) -> None:
    if extra.get("mode") != "disaggregated":
        raise RuntimeError(f"{path} was written by a colocated run; resume it with trainer.mode=colocate")
    if extra.get("placement") != placement.as_dict():
        raise RuntimeError(f"{path} was written with train ranks {extra['placement']['train']} and rollout ranks "
                           f"{extra['placement']['rollout']}; resume it with the same resources.train_resources and "
                           f"resources.rollout_resources (this run: {placement.as_dict()})")

