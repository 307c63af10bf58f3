"""The rollout manager: tasks + produce strategies + replay buffer -> one training batch.

``produce_batch`` (colocated path): split the batch across tasks by weight, let every task's
strategy fill the buffer concurrently, pause the backend and drain what is in flight, then take
the batch. Results are ordered by task name, then group id, whatever order they finished in.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable

from rlcli.produce import ProduceContext, ProduceStats, Task
from rlcli.replay_buffer import ReplayBuffer
from rlcli.types import Group, Status


def allocate_task_batch_sizes(batch_size: int, weights: dict[str, float]) -> dict[str, int]:
    """Largest-remainder split of ``batch_size`` by weight; ties go to the earlier task."""
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    total = sum(weights.values())
    if total <= 0:
        raise ValueError("at least one task weight must be positive")
    if batch_size == 0:
        return {t: 0 for t in weights}
    raw = {t: batch_size * w / total for t, w in weights.items()}
    sizes = {t: math.floor(r) for t, r in raw.items()}
    rest = batch_size - sum(sizes.values())
    names = list(weights)
    frac = [raw[n] - sizes[n] for n in names]
    for i in sorted(range(len(names)), key=lambda i: (-frac[i], i))[:rest]:
        sizes[names[i]] += 1
    return sizes


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(int(q * len(s)), len(s) - 1)]


@dataclass
class BatchResult:
    groups: list[Group]
    task_sizes: dict[str, int]
    metrics: dict[str, float] = field(default_factory=dict)


class RolloutManager:
    def __init__(self, tasks: list[Task], buffer: ReplayBuffer, backend: Any, judge_pools: list[Any]):
        names = [t.name for t in tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate task names: {names}")
        self.tasks = tasks
        self.buffer = buffer
        self.backend = backend
        self.judge_pools = judge_pools

    @property
    def weights(self) -> dict[str, float]:
        return {t.name: t.weight for t in self.tasks}

    async def produce_batch(self, batch_size: int, train_step: int, model_step: int,
                            progress: Callable[[int], None] | None = None) -> BatchResult:
        if batch_size <= 0:
            raise ValueError(f"produce_batch expects batch_size > 0, got {batch_size}")
        sizes = allocate_task_batch_sizes(batch_size, self.weights)
        active = [t for t in self.tasks if sizes[t.name] > 0]
        self.backend.resume()
        self.buffer.refresh(train_step, {t.name: t.rule for t in self.tasks})
        ctxs = {t.name: ProduceContext(sizes[t.name], train_step, model_step, self.buffer, progress) for t in active}
        await asyncio.gather(*(t.strategy.produce_batch(t, ctxs[t.name]) for t in active))
        self.backend.pause()
        await asyncio.gather(*(t.strategy.drain(t, ctxs[t.name]) for t in active))
        taken = self.buffer.take_batch(sizes)
        groups = [g for name in sorted(taken) for g in sorted(taken[name], key=lambda g: g.group_id)]
        if not groups:
            raise RuntimeError("rollout produced no trainable group (every group failed, expired or was filtered)")
        return BatchResult(groups, sizes, self._metrics(groups, sizes, train_step))

    def _metrics(self, groups: list[Group], sizes: dict[str, int], train_step: int) -> dict[str, float]:
        total = ProduceStats()
        m: dict[str, float] = {}
        for t in self.tasks:
            total.merge(t.stats)
            if len(self.tasks) > 1:
                tg = [g for g in groups if g.task_name == t.name]
                scores = [s.score for g in tg for s in g.samples if s.status == Status.COMPLETED]
                m[f"task/{t.name}/groups"] = float(len(tg))
                m[f"task/{t.name}/reward_mean"] = statistics.fmean(scores) if scores else 0.0
            t.stats = ProduceStats()
        samples = [s for g in groups for s in g.samples if s.status == Status.COMPLETED]
        scores = [s.score for s in samples]
        lengths = [len(s.response_ids) for s in samples]
        stale = [s.staleness for s in samples]
        m.update({
            "reward/mean": statistics.fmean(scores) if scores else 0.0,
            "reward/min": min(scores, default=0.0),
            "reward/max": max(scores, default=0.0),
            "reward/raw_mean": total.raw_reward_sum / total.raw_reward_count if total.raw_reward_count else 0.0,
            "response/length_mean": statistics.fmean(lengths) if lengths else 0.0,
            "response/length_max": float(max(lengths, default=0)),
            "response/truncated_frac": (sum(s.finish_reason == "length" for s in samples) / len(samples)) if samples else 0.0,
            "prompt/length_mean": statistics.fmean(len(s.prompt_ids) for s in samples) if samples else 0.0,
            "rollout/groups": float(len(groups)),
            "rollout/samples": float(len(samples)),
            "rollout/tokens": float(total.new_tokens),
            "rollout/produced_samples": float(total.produced_samples),
            "rollout/failed_samples": float(total.failed_samples),
            "rollout/failed_groups": float(total.failed_groups),
            "rollout/filtered_groups": float(total.filtered_groups),
            "rollout/expired_groups": float(total.expired_groups),
            "rollout/staleness_mean": statistics.fmean(stale) if stale else 0.0,
            "rollout/staleness_max": float(max(stale, default=0)),
            "rollout/group_time_p50": _pct(total.group_times, 0.5),
            "rollout/group_time_p99": _pct(total.group_times, 0.99),
            "rollout/leftover_completed_groups": float(self.buffer.count(status=Status.COMPLETED)),
            "rollout/leftover_aborted_groups": float(self.buffer.count(status=Status.ABORTED)),
        })
        for pool in self.judge_pools:
            for k, v in pool.pop_stats().items():
                m[k] = m.get(k, 0.0) + v
        for t in self.tasks:
            for k, v in t.sampler.pop_stats().items():
                m[k] = m.get(k, 0.0) + v
        return m

    # ---------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "buffer": self.buffer.state_dict(),
            "samplers": {t.name: t.sampler.state_dict() for t in self.tasks},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state["buffer"])
        for t in self.tasks:
            if t.name not in state["samplers"]:
                raise ValueError(f"checkpoint has no sampler state for task {t.name!r}")
            t.sampler.load_state_dict(state["samplers"][t.name])
