"""Runners: ``colocate`` (rollout and training take turns on the same ranks) and
``disaggregated`` (separate rollout and train ranks), chosen by ``trainer.mode``."""

from __future__ import annotations

import os
from pathlib import Path

from rlcli.config import Recipe


def run(recipe: Recipe, work_dir: str | Path | None, *, quiet: bool = False,
        overwrite: bool = False) -> tuple[Path, dict[str, float]]:
    """Train with the runner of ``recipe.trainer.mode`` on this rank; returns the work dir and the
    last step's metrics. With ``trainer.auto_resume`` a finished run of the same recipe is only
    reported (its last metrics row), with no model built and nothing written."""
    from rlcli.runner.setup import default_work_dir
    from rlcli.runner.workdir import plan_work_dir

    path = Path(work_dir) if work_dir else default_work_dir(recipe)
    done = plan_work_dir(path, auto_resume=recipe.trainer.auto_resume, overwrite=overwrite, recipe=recipe).finished
    if done is not None:
        if not quiet and os.environ.get("RANK", "0") == "0":  # launched ranks have no process group yet
            print(f"{path} holds this recipe's finished run (step {done['step']}): nothing to do "
                  f"(pass --overwrite to train it again)")
        return path, done
    if recipe.trainer.mode == "disaggregated":
        from rlcli.runner.disaggregated import run_disaggregated

        return run_disaggregated(recipe, work_dir, quiet=quiet, overwrite=overwrite)
    from rlcli.runner.colocate import run_training

    return run_training(recipe, work_dir, quiet=quiet, overwrite=overwrite)


def rank_entry(recipe_path: str, overrides: list[str], work_dir: str | None, quiet: bool,
               overwrite: bool) -> tuple[str, dict[str, float]] | None:
    """What each launched rank runs (module level so that spawned processes can import it);
    returns the work dir and final metrics on rank 0, None elsewhere."""
    from torch.distributed.elastic.multiprocessing.errors import record

    from rlcli.config import load_recipe
    from rlcli.dist import destroy, is_main

    @record
    def _main():
        path, final = run(load_recipe(recipe_path, overrides), work_dir, quiet=quiet, overwrite=overwrite)
        out = (str(path), final) if is_main() else None
        # every rank got here: end the process group in order, not in the interpreter's teardown
        # (gloo's threads can abort it: "terminate called without an active exception"; NCCL warns)
        destroy()
        return out

    return _main()
