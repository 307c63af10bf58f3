"""A run's records: phase timings, the trackers and the metrics rows handed to them, the console
line, the sample rows of the rollout and eval dumps (JSONL), and the pruning of old ``step-N``
directories."""

from __future__ import annotations

import logging
import os
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import yaml

from rlcli.config import ComponentSpec
from rlcli.fsutil import write_jsonl
from rlcli.plugins import get_registry
from rlcli.runner.setup import RESOLVED
from rlcli.types import Group, Sample

log = logging.getLogger("rlcli")


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


# Throughput of a step, for both runners: tokens generated per second of generating them (per
# rollout rank, summed over the ranks) and trained tokens (``train/tokens``) per second of the
# train phase (``timing/train_s``).
ROLLOUT_TOKENS_PER_S = "throughput/rollout_tokens_per_s"
TRAIN_TOKENS_PER_S = "throughput/train_tokens_per_s"


def is_wall_time(key: str) -> bool:
    """Whether metric ``key`` measures wall time or a rate over it (``time``, every ``*_s``, the
    ``*time_p50``/``p99`` percentiles, ``throughput/*``): the metrics in which two runs of the same
    recipe and seed may differ; every other metric of a resumed run equals the uninterrupted one's."""
    return key == "time" or key.endswith("_s") or "time_p" in key or key.startswith("throughput/")


def per_second(amount: float, seconds: float) -> float:
    """``amount / seconds``; 0 when nothing was timed."""
    return amount / seconds if seconds > 0 else 0.0


def add_train_throughput(row: dict[str, float]) -> None:
    """``throughput/train_tokens_per_s`` of a step's merged row (rows without training: none)."""
    if "train/tokens" in row:
        row[TRAIN_TOKENS_PER_S] = per_second(row["train/tokens"], row.get("timing/train_s", 0.0))


def build_trackers(trackers: list[ComponentSpec], work_dir: Path, registry=None) -> list:
    """The experiment trackers ``trainer.exp_tracker`` lists, plus ``jsonl`` (metrics.jsonl) when it is
    not listed, that one from ``registry`` (the recipe's; default: the global registry)."""
    reg = registry or get_registry()
    names = [t.name for t in trackers]
    specs = list(trackers)
    if "jsonl" not in names:
        spec = ComponentSpec(name="jsonl")
        spec._cls, spec._cfg = reg.get("tracker", "jsonl"), reg.get("tracker", "jsonl").Config()
        specs.append(spec)
    built = [s.build(work_dir=work_dir) for s in specs]
    resolved = work_dir / RESOLVED
    if resolved.exists():  # written by write_resolved before the trackers are built
        recipe = yaml.safe_load(resolved.read_text(encoding="utf-8"))["recipe"]
        for t in built:
            t.log_recipe(recipe, resolved)
    return built


SKIPPED_ROWS = "skipped_rows.jsonl"


def write_skipped_rows(out_dir: Path, samplers: list[tuple[str, Any]]) -> Path:
    """``out_dir/skipped_rows.jsonl``: every data row the samplers left out, one object per row
    (``task``, ``file``, ``line``, ``kind``, ``reason``); written even when empty, so that it never
    describes an earlier run's data. Logs how many, and where they are listed."""
    rows = [{"task": name, "file": os.path.abspath(r.file), "line": r.line, "kind": r.kind, "reason": r.reason}
            for name, sampler in samplers for r in sampler.skipped_rows()]
    path = write_jsonl(out_dir / SKIPPED_ROWS, rows)
    if rows:
        log.warning("%d data rows left out (bad, or over max_prompt_length); every one is listed with its "
                    "file:line and reason in %s", len(rows), path)
    return path


def log_to_trackers(trackers: list, step: int, metrics: dict[str, float], groups, samples_per_step: int) -> None:
    """One row to every tracker (plus a few rollouts, the first sample of each of the first
    ``samples_per_step`` groups); a tracker that fails is dropped with a warning, never fatal."""
    rows = [sample_row(g.samples[0]) for g in (groups or [])[:samples_per_step]]
    for t in list(trackers):
        try:
            t.log(step, metrics)
            if rows:
                t.log_samples(step, rows)
        except Exception as exc:  # a tracker must never stop training: drop it and go on
            log.warning("tracker %s failed and is disabled: %s", type(t).__name__, exc)
            trackers.remove(t)


def _figure(x: float) -> str:
    """A loss-sized number readable at any scale: ``+0.1234``, ``-3.21e-06``, ``+0``."""
    return f"{x:+.4f}" if x == 0 or abs(x) >= 1e-3 else f"{x:+.2e}"


def step_summary(m: dict[str, float]) -> str:
    """The console line of a step: reward (steps that rolled out), eval accuracy, loss (scientific
    when small: a GRPO loss on policy is near 0 by construction) and grad norm, step time."""
    parts = [f"reward {m['reward/mean']:.3f}"] if "reward/mean" in m else []
    if "eval/accuracy" in m:
        parts.append(f"eval/acc {m['eval/accuracy']:.3f}")
    if "train/loss" in m:
        parts.append(f"loss {_figure(m['train/loss'])}")
    if "train/grad_norm" in m:
        parts.append(f"grad_norm {m['train/grad_norm']:.3g}")
    parts.append(f"{m.get('timing/step_s', 0):.2f}s")
    return " | ".join(parts)


_COUNTERS = ("judger/", "agent_loop/", "engine/")
_FAILURES = ("errors", "crashes", "timeouts", "out_of_memory", "hung_threads")


def is_counter(key: str) -> bool:
    """Whether ``key`` is one of the engine's, judgers' or agent loops' counters (kept in the files,
    left out of the console's summaries)."""
    return any(x in key for x in _COUNTERS)


def final_summary(m: dict[str, float]) -> str:
    """The end-of-run console line's figures: the last reward and eval metrics, without the
    engine's, judgers' and agent loops' counters."""
    keys = [k for k in m if k == "reward/mean" or (k.startswith("eval/") and not is_counter(k))]
    return " | ".join(f"{k} {m[k]:.4g}" for k in keys)


def eval_lines(m: dict[str, float]) -> list[str]:
    """``rlcli eval``'s console lines: every metric but the counters, and those counters that
    report failures when they are not zero (all of them stay in eval_metrics.json)."""
    keys = sorted(k for k in m if not is_counter(k) or (k.rsplit("/", 1)[-1] in _FAILURES and m[k]))
    return [f"{k}: {m[k]:.4f}" if isinstance(m[k], float) else f"{k}: {m[k]}" for k in keys]


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


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
