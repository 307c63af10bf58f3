"""The rollout manager: tasks + produce strategies + replay buffer -> training batches.

Two drivers share one manager, one buffer and the same strategy objects:

Colocated (``produce_batch``): split the batch across tasks by weight, let every task's strategy
fill the buffer concurrently, pause the backend and drain what is in flight (judge calls get a
grace period, then are cancelled), then take the batch::

    resume -> refresh staleness at t -> strategies fill the buffer -> pause -> drain -> take

Disaggregated (XTuner's §4.5 API): a background producer (``produce_loop``, started with
``start_produce_loop``) keeps filling the buffer for future steps, at most as far ahead of the
served policy as the staleness bound allows; the trainer calls ``get_batch(batch_size, step)``,
and at a weight sync ``pause_produce()`` then ``continue_produce(model_step)``. The manager's
``status`` is NORMAL, UPDATE_WEIGHT_AND_ABORT (paused) or EXPIRED_BATCH (the producer waits
for newer weights); ``get_batch`` returns an empty EXPIRED_BATCH result when the trainer must
sync before data for its step can exist.

Results are ordered by task name, then group id, whatever order they finished in. Metrics are
counts since the previous batch, each in the unit its key names (``..._groups``,
``..._samples``, ``..._tokens``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from rlcli.agent_loops.base import AgentLoop
from rlcli.component import ReportsRolloutMetrics
from rlcli.config.fit import allocate_task_batch_sizes  # the recipe's split of a batch by task weight
from rlcli.produce.base import ProduceContext, ProduceStats, ProduceStatus, Task
from rlcli.produce.replay_buffer import ReplayBuffer
from rlcli.produce.staleness import StalenessRule, mask_stale_tokens
from rlcli.types import Group, Status

log = logging.getLogger(__name__)


def engine_metrics(backend: Any, prefix: str = "engine/") -> dict[str, float]:
    """The backend's counters since the previous call (:meth:`InferenceBackend.stats`: generated
    tokens, busy seconds, engine steps...), as ``<prefix><name>``. Reading resets them. A backend
    whose ``stats()`` fails contributes nothing: metrics never stop a run."""
    try:
        stats = backend.stats()
    except Exception:
        log.warning("backend.stats() failed; no engine/* metrics this step", exc_info=True)
        return {}
    return {f"{prefix}{k}": float(v) for k, v in (stats or {}).items() if isinstance(v, (int, float))}


def _pct(xs: list[float], q: float) -> float:
    """``sorted(xs)[int(q * n)]`` (XTuner's p50/p99), 0 for no data."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(int(q * len(s)), len(s) - 1)]


async def _all_or_cancel(coros: list) -> list:
    """Run coroutines concurrently; on the first error cancel the others, then raise it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return []
    try:
        _, rest = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:
        rest = {t for t in tasks if not t.done()}
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)
        raise
    for t in rest:
        t.cancel()
    if rest:
        await asyncio.wait(rest)
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()
    return [t.result() for t in tasks]


@dataclass
class BatchResult:
    groups: list[Group]
    task_sizes: dict[str, int]
    metrics: dict[str, float] = field(default_factory=dict)
    status: ProduceStatus = ProduceStatus.NORMAL


class RolloutManager:
    """Tasks, their strategies and the shared replay buffer (see the module docstring).

    Args:
        allocate: ``(batch_size, step) -> {task: groups}``; default: largest-remainder split by
            weight (the same every step).
    """

    def __init__(self, tasks: list[Task], buffer: ReplayBuffer, backend: Any, judge_pools: list[Any], *,
                 allocate: Callable[[int, int], dict[str, int]] | None = None):
        if not tasks:
            raise ValueError("the rollout manager needs at least one task")
        names = [t.name for t in tasks]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"duplicate task name {dup!r} in {names}")
        if sum(t.weight for t in tasks) <= 0:
            raise ValueError("at least one task weight must be positive")
        self.tasks = tasks
        self.buffer = buffer
        self.backend = backend
        self.judge_pools = judge_pools
        self._allocate = allocate
        # disaggregated progress (all absolute; see XTuner §4.5)
        self.status = ProduceStatus.NORMAL
        self.model_step = 0  # policy version the backend serves
        self.producer_future_step = 1  # the step the background producer fills the buffer for
        self.next_consumer_step = 1  # the step the trainer will ask for next
        self.target_upto_future_step = 0
        self.target_samples = {n: 0 for n in names}  # cumulative groups to produce, per task
        self.consumed_samples = {n: 0 for n in names}  # cumulative groups taken by the trainer
        self._stop = asyncio.Event()  # set while a pause is requested
        self._running = asyncio.Event()  # set while status is NORMAL
        self._running.set()
        self._changed = asyncio.Event()  # something the consumer waits for happened
        self._producer: asyncio.Task | None = None
        self._producer_error: BaseException | None = None
        self._finished = False
        self._ctxs: dict[str, ProduceContext] = {}
        self._pause_s = 0.0

    @property
    def weights(self) -> dict[str, float]:
        return {t.name: t.weight for t in self.tasks}

    @property
    def rules(self) -> dict[str, StalenessRule]:
        return {t.name: t.rule for t in self.tasks}

    @property
    def pending(self) -> int:
        """Rollout groups in flight, all tasks."""
        return sum(t.strategy.pending for t in self.tasks)

    def allocate(self, batch_size: int, step: int) -> dict[str, int]:
        if self._allocate is not None:
            sizes = self._allocate(batch_size, step)
        else:
            sizes = allocate_task_batch_sizes(batch_size, self.weights)
        names = {t.name for t in self.tasks}
        if set(sizes) != names or any(int(n) != n or n < 0 for n in sizes.values()):
            raise ValueError(f"task allocation must give every task ({sorted(names)}) a group count >= 0, got {sizes}")
        return {t.name: int(sizes[t.name]) for t in self.tasks}

    # ============================================================================= colocated
    async def produce_batch(self, batch_size: int, train_step: int, model_step: int,
                            progress: Callable[[int], None] | None = None) -> BatchResult:
        """Roll out one step's batch with the backend serving policy ``model_step`` (colocated)."""
        if batch_size <= 0:
            raise ValueError(f"produce_batch expects batch_size > 0, got {batch_size}")
        if self.producer_running:
            raise RuntimeError("produce_batch (colocated) cannot run while the background producer runs; "
                               "use get_batch")
        sizes = self.allocate(batch_size, train_step)
        active = [t for t in self.tasks if sizes[t.name] > 0]
        self.model_step = model_step
        self.backend.resume()
        self._refresh(train_step)
        ctxs = {t.name: ProduceContext(sizes[t.name], train_step, model_step, self.buffer, progress) for t in active}
        # Every task produces until its own goal; no task pauses the backend while another still needs it.
        error: BaseException | None = None
        try:
            await _all_or_cancel([t.strategy.produce_batch(t, ctxs[t.name]) for t in active])
        except BaseException as exc:  # still pause and drain: nothing may stay in flight
            error = exc
        self.backend.pause()
        t0 = time.perf_counter()
        drained = await asyncio.gather(*(t.strategy.drain(t, ctxs[t.name]) for t in active), return_exceptions=True)
        self._pause_s += time.perf_counter() - t0
        error = error or next((e for e in drained if isinstance(e, BaseException)), None)
        if error is not None:
            raise error
        result = self._take(sizes, train_step, ProduceStatus.NORMAL)
        if not result.groups:
            raise RuntimeError("rollout produced no trainable group (every group failed, expired or was filtered)")
        return result

    # ========================================================================= disaggregated
    @property
    def producer_running(self) -> bool:
        return self._producer is not None and not self._producer.done()

    def start_produce_loop(self, batch_size: int) -> asyncio.Task:
        """Start :meth:`produce_loop` as a background task of the running event loop."""
        if self.producer_running:
            raise RuntimeError("the background producer is already running")
        if batch_size <= 0:
            raise ValueError(f"produce_loop expects batch_size > 0, got {batch_size}")
        self._producer_error = None
        self._producer = asyncio.ensure_future(self.produce_loop(batch_size))
        # its error is re-raised by get_batch (and logged); do not also report it as "never retrieved"
        self._producer.add_done_callback(lambda t: t.cancelled() or t.exception())
        return self._producer

    def ensure_target_upto(self, batch_size: int, future_step: int) -> dict[str, int]:
        """Add the allocations of every step up to ``future_step`` to the cumulative targets;
        return the allocation of ``future_step``."""
        while self.target_upto_future_step < future_step:
            self.target_upto_future_step += 1
            for name, n in self.allocate(batch_size, self.target_upto_future_step).items():
                self.target_samples[name] += n
        return self.allocate(batch_size, future_step)

    def _ctx(self, task: Task) -> ProduceContext:
        ctx = self._ctxs.get(task.name)
        if ctx is None:
            ctx = ProduceContext(0, self.next_consumer_step, self.model_step, self.buffer,
                                 progress=lambda n: self._changed.set(), target=0, stop=self._stop)
            self._ctxs[task.name] = ctx
        return ctx

    def _set_status(self, status: ProduceStatus) -> None:
        self.status = status
        if status == ProduceStatus.NORMAL:
            self._running.set()
        else:
            self._running.clear()
        self._changed.set()

    async def produce_loop(self, batch_size: int) -> None:
        """Background producer: one round per future step, all tasks concurrently.

        A round ends NORMAL when every task reached its cumulative target (the producer moves to
        the next future step), UPDATE_WEIGHT_AND_ABORT when a pause was requested, or
        EXPIRED_BATCH when data for the future step would already be expired under the served
        policy (``future - model_step - 1 >= stale_threshold``): then it waits for
        :meth:`continue_produce`. Groups in flight keep running across rounds.
        """
        if batch_size <= 0:
            raise ValueError(f"produce_loop expects batch_size > 0, got {batch_size}")
        self._finished = False
        try:
            while not self._finished:
                if self.status != ProduceStatus.NORMAL:
                    await self._running.wait()
                    continue
                step = self.producer_future_step
                sizes = self.ensure_target_upto(batch_size, step)
                active = [t for t in self.tasks if self.target_samples[t.name] > 0]
                if any(t.strategy.model_expired(step, self.model_step) for t in active):
                    self._set_status(ProduceStatus.EXPIRED_BATCH)
                    continue
                for t in active:
                    ctx = self._ctx(t)
                    ctx.batch_size, ctx.target, ctx.future_step = sizes[t.name], self.target_samples[t.name], step
                    ctx.consumed, ctx.model_step = self.consumed_samples[t.name], self.model_step
                    ctx.train_step = self.next_consumer_step
                statuses = await _all_or_cancel([t.strategy.produce_round(t, self._ctxs[t.name]) for t in active])
                if ProduceStatus.UPDATE_WEIGHT_AND_ABORT in statuses:
                    pass  # pause_produce() set the status; continue_produce() resumes this same step
                elif ProduceStatus.EXPIRED_BATCH in statuses:
                    if self.status == ProduceStatus.NORMAL:
                        self._set_status(ProduceStatus.EXPIRED_BATCH)
                else:
                    self.producer_future_step += 1
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.error("the background producer failed: %s: %s", type(exc).__name__, exc)
            self._producer_error = exc
            self._changed.set()
            raise

    async def get_batch(self, batch_size: int, train_step: int, *, timeout_s: float | None = None) -> BatchResult:
        """The batch of consumer step ``train_step`` (disaggregated); waits for the producer.

        Returns an empty result with status EXPIRED_BATCH when the producer is waiting for newer
        weights and ``train_step - 1 > model_step`` (sync, ``continue_produce``, then ask again).
        Raises the producer's error if it died, ``TimeoutError`` after ``timeout_s``.
        """
        if batch_size <= 0:
            raise ValueError(f"get_batch expects batch_size > 0, got {batch_size}")
        self._set_consumer_step(train_step)
        self._refresh(train_step)
        sizes = self.allocate(batch_size, train_step)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._changed.clear()
            if self._producer_error is not None:
                raise RuntimeError("the background producer failed") from self._producer_error
            ready = self.buffer.is_ready(sizes)
            if self.status == ProduceStatus.EXPIRED_BATCH:
                if train_step - 1 > self.model_step:
                    return BatchResult([], sizes, self._metrics([], train_step), ProduceStatus.EXPIRED_BATCH)
                if not ready:
                    raise RuntimeError("RolloutManager reached EXPIRED_BATCH without a newer model or a ready batch: "
                                       + self._invariants(sizes, train_step))
            if ready:
                expired = self.status == ProduceStatus.EXPIRED_BATCH
                result = self._take(sizes, train_step, ProduceStatus.EXPIRED_BATCH if expired else ProduceStatus.NORMAL)
                for g in result.groups:
                    self.consumed_samples[g.task_name] += 1
                for name, ctx in self._ctxs.items():
                    ctx.consumed = self.consumed_samples[name]
                self._set_consumer_step(train_step + 1)
                self._refresh(train_step + 1)
                return result
            if not self.producer_running:
                raise RuntimeError(f"get_batch(step {train_step}): the buffer is not ready and no producer is "
                                   f"running (start_produce_loop first): " + self._invariants(sizes, train_step))
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"get_batch(step {train_step}) waited {timeout_s}s: "
                                   + self._invariants(sizes, train_step))
            try:
                await asyncio.wait_for(self._changed.wait(), 0.5 if left is None else min(0.5, left))
            except asyncio.TimeoutError:
                pass

    async def pause_produce(self) -> None:
        """Stop producing for a weight sync: no new rollout starts, the backend aborts what is in
        flight (partial responses come back ABORTED), judge calls get their grace period."""
        self._set_status(ProduceStatus.UPDATE_WEIGHT_AND_ABORT)
        self._stop.set()
        self.backend.pause()
        t0 = time.perf_counter()
        active = [t for t in self.tasks if t.name in self._ctxs or t.strategy.pending]
        results = await asyncio.gather(*(t.strategy.drain(t, self._ctx(t)) for t in active), return_exceptions=True)
        self._pause_s += time.perf_counter() - t0
        err = next((e for e in results if isinstance(e, BaseException)), None)
        if err is not None:
            raise err

    async def continue_produce(self, model_step: int) -> None:
        """Resume producing with the backend now serving policy ``model_step``."""
        self.model_step = model_step
        for ctx in self._ctxs.values():
            ctx.model_step = model_step
        self.backend.resume()
        self._stop.clear()
        self._set_status(ProduceStatus.NORMAL)

    async def shutdown(self) -> None:
        """Stop the background producer and drain everything in flight."""
        self._finished = True
        producer, self._producer = self._producer, None
        if producer is not None and not producer.done():
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)
        await self.pause_produce()

    def _set_consumer_step(self, step: int) -> None:
        self.next_consumer_step = step
        for ctx in self._ctxs.values():
            ctx.train_step = step

    def _invariants(self, sizes: dict[str, int], train_step: int) -> str:
        return (f"status={self.status.value} train_step={train_step} model_step={self.model_step} "
                f"producer_future_step={self.producer_future_step} next_consumer_step={self.next_consumer_step} "
                f"target_upto_future_step={self.target_upto_future_step} target_samples={self.target_samples} "
                f"consumed_samples={self.consumed_samples} needed={sizes} "
                f"completed_in_buffer={ {t.name: self.buffer.count(t.name, Status.COMPLETED) for t in self.tasks} } "
                f"pending={ {t.name: t.strategy.pending for t in self.tasks} }")

    # ================================================================================ shared
    def _refresh(self, step: int) -> None:
        """Re-apply every task's staleness rule to the stored groups at consumer step ``step``."""
        by_name = {t.name: t for t in self.tasks}
        for name, n in self.buffer.refresh(step, self.rules).items():
            by_name[name].stats.expired_groups += n

    def _take(self, sizes: dict[str, int], step: int, status: ProduceStatus) -> BatchResult:
        self._refresh(step)  # whatever happened since, nothing taken is past its bound at `step`
        taken = self.buffer.take_batch(sizes)
        masked = sum(mask_stale_tokens(taken.get(t.name, []), step, t.rule.token_stale_threshold) for t in self.tasks)
        groups = [g for name in sorted(taken) for g in sorted(taken[name], key=lambda g: g.group_id)]
        metrics = self._metrics(groups, step)
        metrics["rollout/masked_stale_tokens"] = float(masked)
        return BatchResult(groups, sizes, metrics, status)

    def _metrics(self, groups: list[Group], train_step: int) -> dict[str, float]:
        total = ProduceStats()
        m: dict[str, float] = {}
        multi = len(self.tasks) > 1
        for t in self.tasks:
            st, t.stats = t.stats, ProduceStats()
            total.merge(st)
            if multi:
                tg = [g for g in groups if g.task_name == t.name]
                done = [s for g in tg for s in g.samples if s.status == Status.COMPLETED]
                scores = [s.score for s in done]
                p = f"task/{t.name}/"
                m.update({
                    p + "groups": float(len(tg)),
                    p + "samples": float(len(done)),
                    p + "reward_mean": statistics.fmean(scores) if scores else 0.0,
                    p + "staleness_max": float(max((s.staleness for s in done), default=0)),
                    p + "tokens": float(st.new_tokens),
                    p + "failed_samples": float(st.failed_samples),
                    p + "filtered_groups": float(st.filtered_groups),
                    p + "expired_groups": float(st.expired_groups),
                    p + "aborted_groups": float(st.aborted_groups),
                    p + "dropped_retry_groups": float(st.dropped_retry_groups),
                    p + "partial_resumed_samples": float(st.partial_resumed_samples),
                    p + "leftover_completed_groups": float(self.buffer.count(t.name, Status.COMPLETED)),
                })
        samples = [s for g in groups for s in g.samples if s.status == Status.COMPLETED]
        scores = [s.score for s in samples]
        lengths = [len(s.response_ids) for s in samples]
        stale = [s.staleness for s in samples]
        pause_s, self._pause_s = self._pause_s, 0.0
        m.update({
            "reward/mean": statistics.fmean(scores) if scores else 0.0,
            "reward/std": statistics.pstdev(scores) if scores else 0.0,
            "reward/min": min(scores, default=0.0),
            "reward/max": max(scores, default=0.0),
            "reward/raw_mean": math.fsum(total.raw_rewards) / len(total.raw_rewards) if total.raw_rewards else 0.0,
            "response/length_mean": statistics.fmean(lengths) if lengths else 0.0,
            "response/length_max": float(max(lengths, default=0)),
            "response/truncated_frac": (sum(s.finish_reason == "length" for s in samples) / len(samples)) if samples else 0.0,
            "rollout/loss_excluded_samples": float(sum(s.excluded_from_loss for s in samples)),
            "prompt/length_mean": statistics.fmean(len(s.prompt_ids) for s in samples) if samples else 0.0,
            "rollout/groups": float(len(groups)),
            "rollout/samples": float(len(samples)),
            "rollout/tokens": float(total.new_tokens),
            "rollout/produced_samples": float(total.produced_samples),
            "rollout/failed_samples": float(total.failed_samples),
            "rollout/failed_groups": float(total.failed_groups),
            "rollout/filtered_groups": float(total.filtered_groups),
            "rollout/expired_groups": float(total.expired_groups),
            "rollout/aborted_groups": float(total.aborted_groups),
            "rollout/dropped_retry_groups": float(total.dropped_retry_groups),
            "rollout/partial_resumed_samples": float(total.partial_resumed_samples),
            "rollout/rerolled_samples": float(total.rerolled_samples),
            "rollout/tail_batch_windows": float(total.tail_batch_windows),
            "rollout/staleness_mean": statistics.fmean(stale) if stale else 0.0,
            "rollout/staleness_max": float(max(stale, default=0)),
            "rollout/group_time_p50": _pct(total.group_times, 0.5),
            "rollout/group_time_p99": _pct(total.group_times, 0.99),
            "timing/rollout_pause_s": pause_s,
            "rollout/leftover_completed_groups": float(self.buffer.count(status=Status.COMPLETED)),
            "rollout/leftover_aborted_groups": float(self.buffer.count(status=Status.ABORTED)),
            "rollout/leftover_expired_groups": float(self.buffer.count(status=Status.EXPIRED)),
        })
        for pool in self.judge_pools:
            for k, v in pool.pop_stats().items():
                m[k] = m.get(k, 0.0) + v
        m.update(engine_metrics(self.backend))
        for t in self.tasks:
            stats = t.sampler.pop_stats()
            if isinstance(t.agent_loop, AgentLoop):  # agent_loop/errors
                stats = {**stats, **t.agent_loop.pop_stats()}
            for k, v in stats.items():
                m[k] = m.get(k, 0.0) + v
            if isinstance(t.agent_loop, ReportsRolloutMetrics):  # e.g. tool/* of multi-turn loops
                mine = [s for g in groups if g.task_name == t.name for s in g.samples]
                for k, v in t.agent_loop.rollout_metrics(mine).items():
                    m[f"task/{t.name}/{k}" if multi else k] = v
        return m

    # ============================================================================ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Buffer (aborted partial responses included), sampler positions, strategy and
        producer progress. Raises while rollout groups are in flight (pause first)."""
        pending = self.pending
        if pending:
            raise RuntimeError(f"Cannot save the RolloutManager while pending rollout tasks still exist "
                               f"({pending} groups in flight); call pause_produce() first")
        return {
            "buffer": self.buffer.state_dict(),
            "samplers": {t.name: t.sampler.state_dict() for t in self.tasks},
            "strategies": {t.name: t.strategy.state_dict() for t in self.tasks},
            "progress": {
                "model_step": self.model_step,
                "producer_future_step": self.producer_future_step,
                "next_consumer_step": self.next_consumer_step,
                "target_upto_future_step": self.target_upto_future_step,
                "target_samples": dict(self.target_samples),
                "consumed_samples": dict(self.consumed_samples),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. The producer stays paused until :meth:`continue_produce`."""
        if self.producer_running or self.pending:
            raise RuntimeError("cannot load a RolloutManager state while rollouts are running")
        for t in self.tasks:
            if t.name not in state["samplers"]:
                raise ValueError(f"checkpoint has no sampler state for task {t.name!r}")
        self.buffer.load_state_dict(state["buffer"])
        for t in self.tasks:
            t.sampler.load_state_dict(state["samplers"][t.name])
            if t.name in state.get("strategies", {}):
                t.strategy.load_state_dict(state["strategies"][t.name])
        p = state.get("progress")
        if p is not None:
            names = {t.name for t in self.tasks}
            self.model_step = int(p["model_step"])
            self.producer_future_step = int(p["producer_future_step"])
            self.next_consumer_step = int(p["next_consumer_step"])
            self.target_upto_future_step = int(p["target_upto_future_step"])
            self.target_samples = {n: int(p["target_samples"].get(n, 0)) for n in names}
            self.consumed_samples = {n: int(p["consumed_samples"].get(n, 0)) for n in names}
        self._stop.set()
        self._set_status(ProduceStatus.UPDATE_WEIGHT_AND_ABORT)
