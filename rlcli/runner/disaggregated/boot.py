"""A disaggregated run's start-up: every rank joins the job, checks the placement (which ranks train,
which roll out), creates the process groups and prepares the work dir."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlcli.config import Recipe, check_launch, resolve_placement
from rlcli.dist import barrier, init_distributed
from rlcli.models import resolve_device
from rlcli.runner.setup import Environment, default_work_dir, seed_everything, setup_logging, write_resolved
from rlcli.runner.workdir import prepare_work_dir
from rlcli.runner.transport import Channels, Placement


@dataclass
class _Boot:
    recipe: Recipe
    work_dir: Path
    rank: int
    placement: Placement
    channels: Channels
    checkpoint: Path | None
    quiet: bool
    env: Environment


def _boot(recipe: Recipe, work_dir: str | Path | None, quiet: bool, overwrite: bool) -> _Boot:
    """Join the job, check the placement, create the groups, prepare the work dir (every rank)."""
    from rlcli.train.checkpoint import latest_checkpoint

    cfg = recipe.trainer
    device = resolve_device(recipe.resources.device)
    rank, world = init_distributed(device)
    issues = check_launch(recipe, world)
    if issues:
        raise ValueError("disaggregated placement: " + "; ".join(str(i) for i in issues))
    train, rollout, _ = resolve_placement(recipe.resources, world)
    placement = Placement(train, rollout)
    channels = Channels.create(placement, device, cfg.peer_timeout_s)
    work_dir = Path(work_dir) if work_dir else default_work_dir(recipe)
    coordinator = rank == placement.train0
    ckpt = None
    if rank == 0:  # rank 0 decides between resuming and starting fresh (and cleans up)
        ckpt = prepare_work_dir(work_dir, auto_resume=cfg.auto_resume, overwrite=overwrite)
        write_resolved(recipe, work_dir)
    barrier()
    if coordinator:
        setup_logging(work_dir, quiet)
    if rank != 0 and cfg.auto_resume and not overwrite:
        ckpt = latest_checkpoint(work_dir / "checkpoints")
    seed_everything(cfg.seed + rank)
    env = Environment(recipe, work_dir)
    return _Boot(recipe, work_dir, rank, placement, channels, ckpt, quiet or not coordinator, env)

