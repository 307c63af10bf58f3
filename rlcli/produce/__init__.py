"""Produce strategies: how many groups to roll out, and when, for one task.

A strategy fills the replay buffer until its task has ``ctx.batch_size`` COMPLETED groups.
Every finished group goes through :meth:`ProduceStrategy.put_generated`: raw-reward stats,
group filters (FILTERED groups are discarded and replaced), FAILED groups discarded, the rest
stored with the task's staleness rule.

* ``sync``: launch exactly the missing groups, wait, replace discarded ones (XTuner's
  SyncProduceStrategy; strict on-policy with ``sync_weights_interval: 1``).
* ``async``: over-sample, keep leftovers and aborted partial responses across steps within a
  staleness bound, re-roll expired groups (tail batch), continue partial rollouts (XTuner's
  AsyncProduceStrategy, with the partial-rollout flag per task and ``tail_batch_max_tries``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from pydantic import Field

from rlcli import hookimpl
from rlcli.component import Component, ComponentConfig
from rlcli.replay_buffer import ReplayBuffer, StalenessRule
from rlcli.types import Group, Status

log = logging.getLogger(__name__)


@dataclass
class ProduceStats:
    """Counters of one production window; read once and reset by the manager."""

    produced_samples: int = 0
    new_tokens: int = 0
    raw_reward_sum: float = 0.0
    raw_reward_count: int = 0
    failed_samples: int = 0
    failed_groups: int = 0
    filtered_groups: int = 0
    expired_groups: int = 0
    dropped_retries: int = 0
    partial_resumed: int = 0
    group_times: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def merge(self, other: "ProduceStats") -> None:
        for k, v in vars(other).items():
            if isinstance(v, list):
                getattr(self, k).extend(v)
            else:
                setattr(self, k, getattr(self, k) + v)


@dataclass
class Task:
    """Everything one task needs at run time (built by the runner from a TaskConfig)."""

    name: str
    weight: float
    sampler: Any
    agent_loop: Any
    strategy: "ProduceStrategy"
    filters: list[Any] = field(default_factory=list)
    rule: StalenessRule = field(default_factory=StalenessRule)
    stats: ProduceStats = field(default_factory=ProduceStats)


@dataclass
class ProduceContext:
    batch_size: int  # COMPLETED groups this task must have in the buffer
    train_step: int  # the consumer step the data is for
    model_step: int  # policy version the backend is serving
    buffer: ReplayBuffer
    progress: Callable[[int], None] | None = None  # called with 1 per stored COMPLETED group


class ProduceStrategyConfig(ComponentConfig):
    max_failed_groups: int = Field(
        64, gt=0, description="Stop the run when this many groups in a row fail (e.g. a judger that always raises)."
    )


class ProduceStrategy(Component):
    """Base class of produce strategies."""

    Config: ClassVar[type[ProduceStrategyConfig]] = ProduceStrategyConfig

    def __init__(self, config: ProduceStrategyConfig, *, sync_weights_interval: int = 1):
        super().__init__(config)
        self.sync_weights_interval = sync_weights_interval
        self._failed_in_a_row = 0

    def staleness_rule(self) -> StalenessRule:
        """Sync strategies never keep data past its sync window and never retry expired groups."""
        return StalenessRule(stale_threshold=self.sync_weights_interval, retryable=False)

    async def produce_batch(self, task: Task, ctx: ProduceContext) -> None:
        raise NotImplementedError

    async def drain(self, task: Task, ctx: ProduceContext) -> None:
        """After the backend is paused: collect what is still in flight (nothing for sync)."""

    async def run_group(self, task: Task, group: Group) -> Group:
        t0 = time.perf_counter()
        await task.agent_loop.run_group(group.samples)
        task.stats.group_times.append(time.perf_counter() - t0)
        return group

    def put_generated(self, task: Task, group: Group, ctx: ProduceContext) -> Status | None:
        """Account for a finished group and store it; return its stored status (None: discarded)."""
        st = task.stats
        st.produced_samples += len(group.samples)
        st.new_tokens += sum(len(s.response_ids) for s in group.samples)  # refined by the agent loop later
        status = group.status
        failed = [s for s in group.samples if s.status == Status.FAILED]
        st.failed_samples += len(failed)
        for s in failed[:1]:
            if s.error:
                st.errors.append(s.error)
        if status == Status.COMPLETED:
            for s in group.samples:
                if s.status == Status.COMPLETED and s.reward is not None:
                    st.raw_reward_sum += s.score
                    st.raw_reward_count += 1
            for f in task.filters:
                if not f.keep(group):
                    for s in group.samples:
                        if s.status == Status.COMPLETED:
                            s.status = Status.FILTERED
                    st.filtered_groups += 1
                    self._failed_in_a_row = 0
                    return None
        if status == Status.FAILED:
            st.failed_groups += 1
            self._failed_in_a_row += 1
            if self._failed_in_a_row >= self.config.max_failed_groups:
                reasons = "; ".join(dict.fromkeys(st.errors[-5:])) or "no error message"
                raise RuntimeError(
                    f"task {task.name!r}: {self._failed_in_a_row} groups in a row failed completely "
                    f"(every sample FAILED); last reasons: {reasons}"
                )
            return None
        self._failed_in_a_row = 0
        stored = ctx.buffer.put(group, consumer_step=ctx.train_step, rule=task.rule)
        if stored is None:
            st.expired_groups += 1
        elif stored == Status.COMPLETED and ctx.progress is not None:
            ctx.progress(1)
        return stored


class SyncProduceStrategy(ProduceStrategy):
    """Roll out exactly the groups the step needs with the current weights (on-policy)."""

    name: ClassVar[str] = "sync"

    async def produce_batch(self, task: Task, ctx: ProduceContext) -> None:
        completed = ctx.buffer.count(task.name, Status.COMPLETED)
        pending: set[asyncio.Task] = set()
        try:
            while completed < ctx.batch_size:
                while len(pending) + completed < ctx.batch_size:
                    group = Group(0, task.name, task.sampler.sample_group())
                    group.group_id = group.samples[0].group_id
                    pending.add(asyncio.ensure_future(self.run_group(task, group)))
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in sorted(done, key=lambda f: f.result().group_id):
                    if self.put_generated(task, fut.result(), ctx) == Status.COMPLETED:
                        completed += 1
        finally:
            for fut in pending:
                fut.cancel()


class AsyncProduceStrategyConfig(ProduceStrategyConfig):
    over_sample_threshold: float = Field(
        0.0, ge=0, description="Extra groups in flight, as a fraction of the task's batch size.")
    enable_partial_rollout: bool = Field(
        False, description="Continue responses paused at a weight sync instead of restarting them.")
    max_staleness: int = Field(
        0, ge=0, description="Extra sync windows a sample may lag: expires at (max_staleness+1)*sync_weights_interval.")
    max_token_staleness: int | None = Field(
        None, ge=0, description="Mask (not drop) tokens older than (max_token_staleness+1)*sync_weights_interval.")
    tail_batch_trigger_size: int = Field(
        -1, ge=-1, description="-1: drop expired groups; 0: re-roll them at once; N: tail-batch mode once N are pooled.")
    tail_batch_max_tries: int | None = Field(
        None, gt=0, description="Drop (and count) a sample re-rolled from scratch this many times.")


class AsyncProduceStrategy(ProduceStrategy):
    """Over-sample and reuse leftovers within a staleness bound; continue partial rollouts."""

    name: ClassVar[str] = "async"
    Config: ClassVar[type[AsyncProduceStrategyConfig]] = AsyncProduceStrategyConfig

    def __init__(self, config: AsyncProduceStrategyConfig, *, sync_weights_interval: int = 1):
        super().__init__(config, sync_weights_interval=sync_weights_interval)
        self._pending: set[asyncio.Future] = set()
        if config.max_staleness > 0 and not config.enable_partial_rollout:
            log.warning("max_staleness=%d with enable_partial_rollout=false: paused responses restart from "
                        "scratch and may be retried many times; prefer enable_partial_rollout=true "
                        "(or set tail_batch_max_tries)", config.max_staleness)
        if config.max_token_staleness is not None and config.max_token_staleness > config.max_staleness:
            log.warning("max_token_staleness=%d > max_staleness=%d has no effect beyond max_staleness",
                        config.max_token_staleness, config.max_staleness)

    def staleness_rule(self) -> StalenessRule:
        c, i = self.config, self.sync_weights_interval
        return StalenessRule(
            stale_threshold=(c.max_staleness + 1) * i,
            token_stale_threshold=None if c.max_token_staleness is None else (c.max_token_staleness + 1) * i,
            retryable=c.tail_batch_trigger_size >= 0,
        )

    def _next_group(self, task: Task, ctx: ProduceContext, statuses: list[Status]) -> Group | None:
        """A group to roll out: a retry from the buffer first, else a fresh prompt."""
        group = ctx.buffer.pop_for_rollout(task.name, statuses)
        if group is None:
            samples = task.sampler.sample_group()
            return Group(samples[0].group_id, task.name, samples)
        reroll = []
        for s in group.samples:
            if s.status == Status.COMPLETED:
                continue  # a fresh sibling kept from an expired group
            if s.status == Status.ABORTED and self.config.enable_partial_rollout and s.response_ids:
                s.resumes += 1
                task.stats.partial_resumed += 1
                continue  # continued by the agent loop from where it stopped
            reroll.append(s)
        limit = self.config.tail_batch_max_tries
        if limit is not None and any(s.tries >= limit for s in reroll):
            task.stats.dropped_retries += 1  # re-rolled `limit` times already: give up on this prompt
            return self._next_group(task, ctx, statuses)
        for s in reroll:
            s.tries += 1
            s.reset_response()
        return group

    async def produce_batch(self, task: Task, ctx: ProduceContext) -> None:
        c = self.config
        self._pending = set()
        expired = ctx.buffer.count(task.name, Status.EXPIRED)
        tail = c.tail_batch_trigger_size
        take_expired = tail >= 0 and expired > 0 and expired >= tail
        tail_mode = tail > 0 and expired >= tail
        budget = 0 if tail_mode else math.ceil(c.over_sample_threshold * ctx.batch_size)
        scheduled = ctx.batch_size + budget
        statuses = [Status.EXPIRED, Status.ABORTED] if take_expired else [Status.ABORTED]
        while True:
            available = ctx.buffer.count(task.name, Status.COMPLETED)
            if available >= ctx.batch_size:
                return
            while available + len(self._pending) < scheduled:
                group = self._next_group(task, ctx, statuses)
                self._pending.add(asyncio.ensure_future(self.run_group(task, group)))
            done, self._pending = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=lambda f: f.result().group_id):
                self.put_generated(task, fut.result(), ctx)

    async def drain(self, task: Task, ctx: ProduceContext) -> None:
        """The backend is paused: in-flight groups come back ABORTED (or done) and are stored."""
        pending, self._pending = self._pending, set()
        if pending:
            await asyncio.wait(pending)
        for fut in sorted(pending, key=lambda f: f.result().group_id):
            self.put_generated(task, fut.result(), ctx)


@hookimpl
def register_produce_strategies():
    return [SyncProduceStrategy, AsyncProduceStrategy]
