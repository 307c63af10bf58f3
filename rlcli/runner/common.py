"""Pieces every runner (and ``rlcli eval``) shares: building components from a recipe,
evaluation, advantages -> training sequences, and the work-dir layout."""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import yaml

from rlcli.backends.base import BackendContext, InferenceBackend
from rlcli.config import Recipe, TaskConfig, resolved_dict
from rlcli.data.sampler import RECIPE_DIR
from rlcli.dist import barrier, init_distributed, is_main, local_device, rank, world_size
from rlcli.fsutil import write_jsonl
from rlcli.manager import engine_metrics
from rlcli.models import prepare_model_dir, resolve_device, resolve_dtype, tokenizer_source
from rlcli.plugins import get_registry
from rlcli.produce import Task
from rlcli.replay_buffer import StalenessRule
from rlcli.tokenizer import eos_token_ids, load_tokenizer
from rlcli.types import Group, Sample, Status

log = logging.getLogger("rlcli")


def default_work_dir(recipe: Recipe) -> Path:
    if recipe.trainer.work_dir:
        return Path(recipe.trainer.work_dir)
    stem = recipe._source.stem if recipe._source is not None else "run"
    return Path("work_dirs") / stem


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:  # pragma: no cover
        pass


def quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # our own progress bars only


def setup_logging(work_dir: Path | None, quiet: bool = False) -> None:
    quiet_transformers()
    root = logging.getLogger("rlcli")
    root.setLevel(logging.INFO)
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    if not quiet:
        sh = logging.StreamHandler()
        sh.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        sh.setLevel(logging.WARNING)
        root.addHandler(sh)
    if work_dir is not None:
        work_dir.mkdir(parents=True, exist_ok=True)
        fh = logging.FileHandler(work_dir / "run.log")
        fh.setFormatter(fmt)
        root.addHandler(fh)
    root.propagate = False


RUN_OUTPUTS = ("metrics.jsonl", "tensorboard", "checkpoints", "hf", "eval", "rollouts", "model-init",
               "resolved.yaml", "run.log", "trained_groups.jsonl")


class WorkDirInUse(RuntimeError):
    pass


def prepare_work_dir(work_dir: Path, *, auto_resume: bool, overwrite: bool) -> Path | None:
    """Decide between resuming and starting fresh; return the checkpoint to resume from.

    A fresh run never mixes its logs or checkpoints with an earlier run's: it refuses a work dir
    that holds one unless ``overwrite`` (then the earlier outputs are deleted). With
    ``auto_resume`` the latest complete checkpoint is used; without one, leftovers of a run
    that died before its first checkpoint are cleared.
    """
    import shutil

    from rlcli.train.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(work_dir / "checkpoints") if auto_resume and not overwrite else None
    if ckpt is not None:
        return ckpt
    present = [n for n in RUN_OUTPUTS if (work_dir / n).exists()]
    if present and not (overwrite or auto_resume) and {"metrics.jsonl", "checkpoints"} & set(present):
        raise WorkDirInUse(
            f"{work_dir} already holds a run ({', '.join(present)}); pass --overwrite to replace it, "
            f"set trainer.auto_resume=true to continue it, or choose another --work-dir"
        )
    for n in present:
        p = work_dir / n
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return None


class Timer:
    """Accumulates wall time per phase: ``with timer("train"): ...`` -> ``timing/train_s``."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            with torch.profiler.record_function(f"rlcli/{name}"):  # a named range in profiler traces
                yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        out, self.times = {f"timing/{k}_s": v for k, v in self.times.items()}, {}
        return out


class Environment:
    """Device, dtype, model directory and tokenizer of a run."""

    def __init__(self, recipe: Recipe, work_dir: Path):
        self.recipe, self.work_dir = recipe, work_dir
        quiet_transformers()
        if recipe._source is not None:
            RECIPE_DIR.set(recipe._source.resolve().parent)
        device = resolve_device(recipe.resources.device)
        self.rank, self.world_size = init_distributed(device)
        self.device = local_device(device)
        if self.device.type == "cpu" and recipe.resources.num_threads:
            torch.set_num_threads(recipe.resources.num_threads)
        self.dtype = resolve_dtype(recipe.model.dtype, self.device)
        self.seed = recipe.trainer.seed
        if is_main():  # rank 0 materialises a from-scratch model; the others read it
            self.model_dir = prepare_model_dir(recipe.model, work_dir, self.seed)
        barrier()
        if not is_main():
            self.model_dir = prepare_model_dir(recipe.model, work_dir, self.seed)
        self.tokenizer = load_tokenizer(tokenizer_source(recipe.model, self.model_dir))
        self.eos_ids = eos_token_ids(self.tokenizer, self.model_dir)
        if not self.eos_ids:
            raise ValueError(f"the tokenizer of {self.model_dir} defines no EOS token")

    def build_backend(self, version: int = 0, shard: tuple[int, int] | None = None) -> InferenceBackend:
        """The recipe's inference backend; ``shard=(index, replicas)`` when not every rank hosts one."""
        index, replicas = shard if shard is not None else (self.rank, self.world_size)
        ctx = BackendContext(
            model_dir=str(self.model_dir), device=self.device, dtype=self.dtype, eos_token_ids=self.eos_ids,
            pad_token_id=self.tokenizer.pad_token_id, seed=self.seed, version=version,
            rank=index, world_size=replicas,
        )
        return self.recipe.rollout.build(ctx=ctx)


def build_judge_pool(task_cfg: TaskConfig):
    from rlcli.judgers.pool import JudgePool

    return JudgePool(task_cfg.judger.build())


def build_tasks(env: Environment, task_cfgs: list[TaskConfig], backend, *, salt: str, eval_mode: bool = False,
                shard: tuple[int, int] | None = None):
    """Runtime :class:`Task` objects (and their judge pools) for a list of task configs.

    ``shard=(index, count)``: this process's share of the prompts (default: its rank among all ranks).
    """
    interval = env.recipe.trainer.sync_weights_interval
    index, count = shard if shard is not None else (env.rank, env.world_size)
    tasks, pools = [], []
    for tc in task_cfgs:
        pool = build_judge_pool(tc)
        pools.append(pool)
        sampler = tc.sampler.build(tokenizer=env.tokenizer, task_name=tc.task_name, seed=env.seed)
        if hasattr(sampler, "shard"):
            sampler.shard(index, count)  # every rank rolls out distinct prompts
        loop = tc.agent_loop.build(backend=backend, judge_pool=pool, tokenizer=env.tokenizer,
                                   eos_token_ids=env.eos_ids, seed=env.seed, salt=f"{salt}:{tc.task_name}")
        strategy = tc.produce_strategy.build(sync_weights_interval=interval)
        filters = [] if eval_mode else [f.build() for f in tc.group_filters]
        rule = strategy.staleness_rule() if not eval_mode else StalenessRule()
        tasks.append(Task(tc.task_name, tc.weight, sampler, loop, strategy, filters, rule))
    return tasks, pools


def sequences_from_groups(groups: list[Group], estimator):
    """Per-group advantages -> training sequences (FAILED members are left out)."""
    from rlcli.algo.advantage import AdvantageEstimator
    from rlcli.train.data import TrainSequence

    seqs: list[TrainSequence] = []
    adv_values: list[float] = []
    kept = [m for m in ([s for s in g.samples if s.status == Status.COMPLETED and s.reward is not None
                          and s.response_ids] for g in groups) if m]
    rewards = [[s.score for s in members] for members in kept]
    lengths = [[len(s.response_ids) for s in members] for members in kept]
    if hasattr(estimator, "compute_groups"):  # every group at once
        advantages = estimator.compute_groups(rewards, lengths)
    else:  # an estimator with the per-group method only: the base class's loop over it
        advantages = AdvantageEstimator.compute_groups(estimator, rewards, lengths)
    for members, adv in zip(kept, advantages):
        for s, a in zip(members, adv):
            seqs.append(TrainSequence(
                prompt_ids=s.prompt_ids, response_ids=s.response_ids,
                response_mask=s.response_mask or [1] * len(s.response_ids),
                rollout_logprobs=s.logprobs, advantage=float(a), temperature=s.temperature, seq_id=s.uid,
            ))
            adv_values.append(float(a))
    return seqs, adv_values


def sample_row(s: Sample) -> dict[str, Any]:
    from rlcli.agent_loops.multi_turn import episode_stats

    row = {
        "task_name": s.task_name, "uid": s.uid, "group_id": s.group_id, "data_source": s.data_source,
        "prompt": s.prompt_text, "response": s.response, "label": s.label,
        "reward": s.reward.get("score") if s.reward else None, "reward_details": s.reward,
        "status": s.status.value, "finish_reason": s.finish_reason, "error": s.error,
        "prompt_tokens": len(s.prompt_ids), "response_tokens": len(s.response_ids), "staleness": s.staleness,
    }
    episode = episode_stats(s)
    if episode is not None:
        row["tool_turns"], row["tool_calls"] = episode["turns"], episode["tool_calls"]
    return row


class Evaluator:
    """Runs the recipe's eval tasks on the same fixed prompts every time and reduces metrics.

    ``shard=(index, count)``: the share of the eval prompts this process rolls out (default: its
    rank among all ranks, i.e. every rank evaluates).
    """

    def __init__(self, env: Environment, backend, *, shard: tuple[int, int] | None = None):
        recipe = env.recipe
        self.env = env
        self.eval_cfg = recipe.eval
        self.shard = shard
        self.tasks, self.pools = build_tasks(env, recipe.eval.tasks, backend, salt="eval", eval_mode=True,
                                             shard=shard)
        self.metric_components = [m.build() for m in recipe.eval.evaluator.metrics]
        self.backend = backend

    def _shard(self) -> tuple[int, int]:
        return self.shard if self.shard is not None else (rank(), world_size())

    def num_groups(self) -> int:
        """Eval prompts this rank rolls out."""
        index, count = self._shard()
        total = 0
        for t in self.tasks:
            n = self._num_prompts(t.sampler) or len(t.sampler)
            total += len(range(index, n, count))
        return total

    def _num_prompts(self, sampler) -> int | None:
        ev = self.eval_cfg.evaluator
        if ev.sample_num > 0:
            return min(ev.sample_num, len(sampler))
        if ev.sample_ratio > 0:
            return max(1, int(len(sampler) * ev.sample_ratio))
        return None

    async def run(self, step: int, progress=None) -> list[Sample]:
        """Roll out and judge this rank's share of every eval task's prompts."""
        self.backend.resume()
        samples: list[Sample] = []
        for task in self.tasks:
            groups = task.sampler.fixed_groups(self._num_prompts(task.sampler), shard=self._shard())
            for g in groups:  # eval seeds differ per step
                for s in g:
                    s.tries = step
            for fut in asyncio.as_completed([task.agent_loop.run_group(g) for g in groups]):
                await fut
                if progress is not None:
                    progress(1)
            samples += [s for g in groups for s in g]
        return samples

    def metrics(self, samples: list[Sample]) -> dict[str, float]:
        """Evaluator metrics over all ranks' samples (``eval/<task>/...`` when there are several tasks)."""
        return eval_metrics(samples, [t.name for t in self.tasks], self.metric_components)

    def pop_stats(self) -> dict[str, float]:
        """The eval judgers' counters and the backend's (``eval/engine/*``) since the last call."""
        out: dict[str, float] = {}
        for pool in self.pools:
            for k, v in pool.pop_stats().items():
                out[f"eval/{k}"] = out.get(f"eval/{k}", 0.0) + v
        out.update(engine_metrics(self.backend, "eval/engine/"))
        return out

    def close(self) -> None:
        for p in self.pools:
            p.close()


def write_resolved(recipe: Recipe, work_dir: Path) -> None:
    reg = recipe._registry or get_registry()
    used = {}
    for path, kind, spec in recipe.components():
        e = reg.entry(kind, spec.name)
        used[path] = f"{kind} {spec.name} from {e.dist} {e.version}"
    data = {"recipe": resolved_dict(recipe), "plugins": used,
            "versions": {"torch": str(torch.__version__), "transformers": str(__import__("transformers").__version__)}}
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / "resolved.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


def eval_metrics(samples: list[Sample], task_names: list[str], components: list) -> dict[str, float]:
    """Evaluator metrics of the eval tasks ``task_names`` (``eval/<task>/...`` when there are several)."""
    from rlcli.evaluator import evaluate

    out: dict[str, float] = {}
    for name in task_names:
        mine = sorted((s for s in samples if s.task_name == name), key=lambda s: s.uid)
        prefix = "eval/" if len(task_names) == 1 else f"eval/{name}/"
        out.update({prefix + k: v for k, v in evaluate(mine, components).items()})
    if len(task_names) > 1:
        out.update({f"eval/{k}": v for k, v in evaluate(samples, components).items()})
    return out


# ------------------------------------------------------------------- runner bookkeeping
def build_trackers(recipe: Recipe, work_dir: Path) -> list:
    """The recipe's experiment trackers, plus ``jsonl`` (metrics.jsonl) when it is not listed."""
    reg = recipe._registry or get_registry()
    names = [t.name for t in recipe.trainer.exp_tracker]
    specs = list(recipe.trainer.exp_tracker)
    if "jsonl" not in names:
        from rlcli.config import ComponentSpec

        spec = ComponentSpec(name="jsonl")
        spec._cls, spec._cfg = reg.get("tracker", "jsonl"), reg.get("tracker", "jsonl").Config()
        specs.append(spec)
    return [s.build(work_dir=work_dir) for s in specs]


def total_train_steps(recipe: Recipe, tokenizer) -> int:
    """``trainer.total_train_steps``, else prompts // train_batch_size × total_epochs (at least 1)."""
    cfg = recipe.trainer
    if cfg.total_train_steps is not None:
        return cfg.total_train_steps
    n_prompts = sum(len(tc.sampler.build(tokenizer=tokenizer, task_name=tc.task_name, seed=0))
                    for tc in recipe.tasks)
    return max(1, n_prompts // cfg.train_batch_size * cfg.total_epochs)


def log_to_trackers(trackers: list, step: int, metrics: dict[str, float], groups, samples_per_step: int) -> None:
    """One row to every tracker (plus a few rollout texts); a tracker that fails is dropped, never fatal."""
    for t in list(trackers):
        try:
            t.log(step, metrics)
            for g in (groups or [])[:samples_per_step]:
                s = g.samples[0]
                t.log_text(step, "rollout", f"**prompt** {s.prompt_text!r}\n\n**response** {s.response!r}"
                                            f"\n\n**reward** {s.score}")
        except Exception as exc:  # a tracker must never stop training: drop it and go on
            log.warning("tracker %s failed and is disabled: %s", type(t).__name__, exc)
            trackers.remove(t)


def step_summary(m: dict[str, float]) -> str:
    """The console line of a step: reward, eval accuracy, loss, step time."""
    parts = [f"reward {m.get('reward/mean', float('nan')):.3f}"]
    if "eval/accuracy" in m:
        parts.append(f"eval/acc {m['eval/accuracy']:.3f}")
    if "train/loss" in m:
        parts.append(f"loss {m['train/loss']:+.4f}")
    parts.append(f"{m.get('timing/step_s', 0):.2f}s")
    return " | ".join(parts)


def best_and_worst(groups: list[Group], n: int) -> list[Group]:
    """Half the best and half the worst of ``groups`` by mean reward (``n`` in all)."""
    ranked = sorted(groups, key=lambda g: mean([s.score for s in g.samples]), reverse=True)
    return ranked if len(ranked) <= n else ranked[: (n + 1) // 2] + ranked[len(ranked) - n // 2:]


def dump_rollout_groups(work_dir: Path, step: int, groups: list[Group], n: int) -> None:
    """``rollouts/step-N.jsonl``: :func:`best_and_worst` of ``groups``."""
    if n <= 0:
        return
    write_jsonl(work_dir / "rollouts" / f"step-{step}.jsonl",
                [{"step": step, **sample_row(s)} for g in best_and_worst(groups, n) for s in g.samples])


def prune_step_dirs(root: Path, maxkeep: int | None) -> None:
    """Keep only the newest ``maxkeep`` ``step-N`` directories under ``root`` (None/-1/0: keep all)."""
    import shutil

    if not maxkeep or maxkeep < 0 or not root.exists():
        return
    dirs = sorted((d for d in root.iterdir() if d.is_dir() and d.name.startswith("step-") and d.name[5:].isdigit()),
                  key=lambda d: int(d.name[5:]))
    for d in dirs[:-maxkeep]:
        shutil.rmtree(d, ignore_errors=True)


def freeze_heap() -> None:
    """Exempt everything built so far (modules, models, tokenizer: ~400k objects) from the cyclic
    garbage collector. Otherwise each full collection scans them all - about 0.2 s on a small CPU,
    every few steps - and stalls the event loop that feeds the engine, or the trainer."""
    import gc

    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Undo :func:`freeze_heap` when a runner closes. Frozen objects are never collected, so a
    closed runner's trainer, engine and their device memory (GiBs: weights, Adam state, KV
    cache) would otherwise stay allocated for the life of the process as soon as anything
    reaches them through a reference cycle - a second run in the same process, a notebook."""
    import gc

    gc.unfreeze()
    gc.collect()
