"""``rlcli eval``: run a recipe's eval tasks on a checkpoint, an HF export, or the base model."""

from __future__ import annotations

import json
from pathlib import Path

from rlcli.config import Recipe
from rlcli.fsutil import write_jsonl, write_text
from rlcli.runner.evaluation import Evaluator
from rlcli.runner.records import sample_row, write_skipped_rows
from rlcli.runner.setup import Environment, default_work_dir, setup_logging
from rlcli.runner.workdir import check_dir_path, claim_work_dir
from rlcli.stall import StallWatchdog
from rlcli.train.checkpoint import COMPLETE, is_complete, latest_checkpoint
from rlcli.train.checkpoint_files import CheckpointError
from rlcli.train.lora import is_adapter_export
from rlcli.train.weights import is_complete_export


def check_checkpoint(ckpt: Path) -> None:
    """``--checkpoint`` names what eval can load (an HF export, a LoRA adapter export, a complete
    training checkpoint), else :class:`CheckpointError` saying what it is instead: before any model
    loads."""
    if is_complete_export(ckpt) or is_complete(ckpt):
        return
    newest = _newest_inside(ckpt)
    if newest is not None:
        hint = f"; it holds exports or checkpoints: name one, e.g. --checkpoint {newest}"
    elif ckpt.name.startswith("step-") and any(ckpt.iterdir()):
        hint = "; an export or checkpoint missing these was not finished writing (a run killed while saving)"
    else:
        hint = ""
    raise CheckpointError(f"--checkpoint {ckpt}: not a complete HF export (config.json and its safetensors "
                          f"weights), LoRA adapter export (adapter_config.json and its weights) nor training "
                          f"checkpoint (a {COMPLETE} marker){hint}")


def _newest_inside(path: Path) -> Path | None:
    """The newest HF export or complete checkpoint in a work dir, its ``hf/`` or its ``checkpoints/``."""
    for hf in (path / "hf", path):
        exports = [p for p in hf.glob("step-*") if p.name[5:].isdigit() and is_complete_export(p)]
        if exports:
            return max(exports, key=lambda p: int(p.name[5:]))
    return latest_checkpoint(path / "checkpoints") or latest_checkpoint(path)


def run_eval(recipe: Recipe, checkpoint: str | None, out_dir: str | None) -> tuple[dict[str, float], Path]:
    import asyncio

    ckpt = Path(checkpoint) if checkpoint else None
    if ckpt is not None:
        check_checkpoint(ckpt)
    is_hf = ckpt is not None and (ckpt / "config.json").exists()
    if is_hf:  # an HF export: it carries its own tokenizer
        recipe = recipe.model_copy()
        recipe.model = recipe.model.model_copy(update={"path": str(ckpt), "from_scratch": None, "tokenizer": None})
    work_dir = default_work_dir(recipe)
    out = Path(out_dir) if out_dir else work_dir / "eval" / (ckpt.name if ckpt else "base")
    if out_dir is None or recipe.model.from_scratch is not None:  # it writes into the work dir
        claim_work_dir(work_dir)
    check_dir_path(out, "--out-dir" if out_dir else "eval output dir", "--out-dir")
    setup_logging(out, quiet=True)
    env = Environment(recipe, work_dir)
    write_skipped_rows(out, env.prepare_samplers(recipe.eval.tasks))  # the data before any model
    backend = env.build_backend()
    if ckpt is not None and not is_hf:
        worker = env.build_train_worker(total_steps=1)
        if is_adapter_export(ckpt):  # LoRA's HF export: the adapter, on the recipe's base model
            worker.load_adapter(ckpt)
            extra = {}
        else:
            extra = worker.load_checkpoint(ckpt, weights_only=True)
        for bucket in worker.iter_weights():
            backend.update_weights(bucket, int(extra.get("step", 0)))
        del worker
    evaluator = Evaluator(env, recipe.eval, backend, sync_weights_interval=recipe.trainer.sync_weights_interval)
    loop = asyncio.new_event_loop()
    watchdog = StallWatchdog(loop, "evaluation").start()
    try:
        samples = loop.run_until_complete(evaluator.run(step=0))
        metrics = {**evaluator.metrics(samples), **evaluator.pop_stats()}
    finally:
        watchdog.stop()
        evaluator.close()
        backend.shutdown()
        loop.close()
    write_jsonl(out / "eval.jsonl", [sample_row(s) for s in samples])
    write_text(out / "eval_metrics.json", json.dumps(metrics, indent=2))
    return metrics, out
