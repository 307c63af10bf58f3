"""The built-in produce strategies, ``sync`` and ``async``.

* ``sync``: launch exactly the missing groups, wait, replace discarded ones (XTuner's
  SyncProduceStrategy; strict on-policy with ``sync_weights_interval: 1``).
* ``async``: over-sample, keep leftovers and paused partial responses across steps within a
  staleness bound, re-roll expired groups (tail batch), continue partial rollouts (XTuner's
  AsyncProduceStrategy, with the partial-rollout flag per task and ``tail_batch_max_tries``).

The ``async`` strategy serves both drivers of :class:`rlcli.produce.manager.RolloutManager`:

* colocated - ``produce_batch`` fills the buffer for one step, then the manager pauses the
  backend and calls ``drain``: nothing stays in flight across steps;
* disaggregated - ``produce_round`` is called by the manager's background ``produce_loop`` once
  per future step, with in-flight groups kept across rounds; it returns a
  :class:`~rlcli.produce.base.ProduceStatus` (``UPDATE_WEIGHT_AND_ABORT`` when a pause is
  requested, ``EXPIRED_BATCH`` when the producer would run further ahead of the served model
  than the staleness bound allows).

The ``async`` strategy expires samples at ``stale_threshold = (max_staleness + 1) *
sync_weights_interval`` (see :mod:`rlcli.produce.staleness`).
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import ClassVar

from pydantic import Field

from rlcli import hookimpl
from rlcli.produce.base import (
    ProduceContext, ProduceStatus, ProduceStrategy, ProduceStrategyConfig, Task, _is_reroll, _mark_interrupted,
)
from rlcli.produce.staleness import StalenessRule
from rlcli.types import Group, Sample, Status

log = logging.getLogger(__name__)

class SyncProduceStrategy(ProduceStrategy):
    """Roll out exactly the groups the step needs with the current weights (on-policy).

    Groups that come back ABORTED (only possible when something pauses the backend mid-step)
    are stored and restarted from scratch at the start of the next window, so they never leak.
    """

    name: ClassVar[str] = "sync"

    async def produce_batch(self, task: Task, ctx: ProduceContext) -> None:
        completed = ctx.buffer.count(task.name, Status.COMPLETED)
        retries: list[Group] = []
        while completed + len(retries) < ctx.batch_size:
            g = ctx.buffer.pop_for_rollout(task.name, [Status.ABORTED])
            if g is None:
                break
            retries.append(g)
        pending: dict[asyncio.Future, Group] = {}
        try:
            while completed < ctx.batch_size:
                while len(pending) + completed < ctx.batch_size:
                    if retries:
                        group = retries.pop(0)
                        self.prepare_retry(task, group, partial=False)
                    else:
                        samples = task.sampler.sample_group()
                        group = Group(samples[0].group_id, task.name, samples)
                    pending[asyncio.ensure_future(self.run_group(task, group))] = group
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                # in group-id order, so that the buffer's order does not depend on timing
                for fut in sorted(done, key=lambda f: pending[f].group_id):
                    group = pending.pop(fut)
                    if self.put_generated(task, fut.result(), ctx) == Status.COMPLETED:
                        completed += 1
        finally:
            # An error (or a cancellation) stopped the window: nothing in flight is lost - what
            # finished is stored as usual, the rest as ABORTED (restarted next window).
            for fut in pending:
                fut.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            for fut, group in pending.items():
                if fut.cancelled() or fut.exception() is not None:
                    _mark_interrupted(group)
                    if group.status != Status.FAILED:
                        ctx.buffer.put(group)
                    continue
                try:
                    self.put_generated(task, group, ctx)
                except Exception:  # noqa: BLE001 - the error that stopped the window wins
                    log.exception("task %r: storing group %d after an interrupted window", task.name, group.group_id)
            for g in retries:  # never rolled out: back to the buffer as they were
                ctx.buffer.put(g)


class AsyncProduceStrategyConfig(ProduceStrategyConfig):
    over_sample_threshold: float = Field(
        0.0, ge=0, description="Extra groups in flight, as a fraction of the task's batch size (a fixed budget).")
    enable_partial_rollout: bool = Field(
        False, description="Continue responses paused at a weight sync instead of restarting them (this task only).")
    max_staleness: int = Field(
        0, ge=0, description="Extra sync windows a sample may lag: expires at (max_staleness+1)*sync_weights_interval.")
    max_token_staleness: int | None = Field(
        None, ge=0, description="Mask (not drop) tokens older than (max_token_staleness+1)*sync_weights_interval.")
    tail_batch_trigger_size: int = Field(
        -1, ge=-1,
        description="-1: drop expired groups; 0: re-roll them at once; N: tail-batch mode once N are pooled.")
    tail_batch_max_tries: int | None = Field(
        None, gt=0, description="Drop (and count) a group when a member to restart was already re-rolled this often.")


class AsyncProduceStrategy(ProduceStrategy):
    """Over-sample and reuse leftovers within a staleness bound; continue partial rollouts.

    One production window (``produce_batch`` colocated, ``produce_round`` disaggregated):

    * ``expired`` = EXPIRED groups of the task in the buffer; tail-batch mode when
      ``tail_batch_trigger_size > 0`` and ``expired >= tail_batch_trigger_size``;
    * budget = 0 in tail-batch mode, else ``ceil(over_sample_threshold * batch_size)`` -
      fixed, not scaled to the gap; groups are kept in flight up to ``goal + budget``;
    * groups to roll out come from the buffer first - EXPIRED then ABORTED when re-rolling
      expired groups (``tail_batch_trigger_size`` 0, or tail-batch mode), else ABORTED only -
      then fresh prompts;
    * the window ends as soon as the goal is met; what is still in flight is drained (colocated)
      or keeps running into the next round (disaggregated).
    """

    name: ClassVar[str] = "async"
    Config: ClassVar[type[AsyncProduceStrategyConfig]] = AsyncProduceStrategyConfig

    def __init__(self, config: AsyncProduceStrategyConfig, *, sync_weights_interval: int = 1):
        super().__init__(config, sync_weights_interval=sync_weights_interval)
        for msg in self.config_warnings(config):
            log.warning(msg)

    @staticmethod
    def config_warnings(c: AsyncProduceStrategyConfig) -> list[str]:
        out = []
        if c.max_staleness > 0 and not c.enable_partial_rollout:
            out.append(
                f"async produce strategy: max_staleness={c.max_staleness} with enable_partial_rollout=false: paused "
                "responses restart from scratch each window, never grow stale enough to expire and may be retried "
                "again and again; prefer enable_partial_rollout=true"
                + ("" if c.tail_batch_max_tries else " (or set tail_batch_max_tries)"))
        if c.max_token_staleness is not None and c.max_token_staleness > c.max_staleness:
            out.append(f"async produce strategy: max_token_staleness={c.max_token_staleness} > max_staleness="
                       f"{c.max_staleness} has no effect: whole samples expire first")
        if c.max_token_staleness is not None and c.tail_batch_trigger_size == -1:
            out.append("async produce strategy: max_token_staleness with tail_batch_trigger_size=-1: a sample whose "
                       "every token is masked expires and its whole group is dropped")
        return out

    def staleness_rule(self) -> StalenessRule:
        c = self.config
        return StalenessRule.from_windows(self.sync_weights_interval, c.max_staleness, c.max_token_staleness,
                                          retryable=c.tail_batch_trigger_size >= 0)

    # ---------------------------------------------------------------------------- planning
    def plan(self, task: Task, ctx: ProduceContext) -> tuple[int, list[Status], bool]:
        """(over-sample budget, buffer statuses to roll out first, tail-batch mode) for a window."""
        c = self.config
        expired = ctx.buffer.count(task.name, Status.EXPIRED)
        tail = c.tail_batch_trigger_size
        take_expired = tail >= 0 and expired > 0 and expired >= tail
        tail_mode = tail > 0 and expired >= tail
        budget = 0 if tail_mode else math.ceil(c.over_sample_threshold * ctx.batch_size)
        statuses = [Status.EXPIRED, Status.ABORTED] if take_expired else [Status.ABORTED]
        return budget, statuses, tail_mode

    def next_group(self, task: Task, ctx: ProduceContext, statuses: list[Status]) -> Group:
        """A group to roll out: a retry from the buffer (in ``statuses`` order) first, else a fresh prompt."""
        while True:
            group = ctx.buffer.pop_for_rollout(task.name, statuses)
            if group is None:
                samples = task.sampler.sample_group()
                return Group(samples[0].group_id, task.name, samples)
            if self.prepare_retry(task, group, partial=self.config.enable_partial_rollout):
                return group

    def allow_retry(self, task: Task, group: Group, restart: list[Sample]) -> bool:
        limit = self.config.tail_batch_max_tries
        if limit is not None and any(s.tries >= limit for s in restart if _is_reroll(s)):
            task.stats.dropped_retry_groups += 1
            log.debug("task %r: group %d dropped: a member was already re-rolled %d times", task.name,
                      group.group_id, limit)
            return False
        return True

    # ---------------------------------------------------------------------------- producing
    def _interrupt(self, ctx: ProduceContext) -> ProduceStatus | None:
        if ctx.stop is not None and ctx.stop.is_set():
            return ProduceStatus.UPDATE_WEIGHT_AND_ABORT
        if ctx.future_step is not None and self.model_expired(ctx.future_step, ctx.model_step):
            return ProduceStatus.EXPIRED_BATCH
        return None

    async def _fill(self, task: Task, ctx: ProduceContext) -> ProduceStatus:
        budget, statuses, tail_mode = self.plan(task, ctx)
        if tail_mode:
            task.stats.tail_batch_windows += 1
        goal = ctx.goal
        scheduled = goal + budget
        stop_wait: asyncio.Future | None = None
        try:
            while True:
                self._prune()
                self._raise_errors()
                status = self._interrupt(ctx)
                if status is not None:
                    return status
                available = ctx.available(task.name)
                if available >= goal:
                    return ProduceStatus.NORMAL
                while available + len(self._pending) < scheduled:
                    status = self._interrupt(ctx)  # checked with no await before the spawn: atomic
                    if status is not None:
                        return status
                    self._spawn(task, self.next_group(task, ctx, statuses), ctx)
                waiters: list[asyncio.Future] = list(self._pending)
                if ctx.stop is not None:
                    if stop_wait is None or stop_wait.done():
                        stop_wait = asyncio.ensure_future(ctx.stop.wait())
                    waiters.append(stop_wait)
                # the timeout re-checks progress made by others (the trainer consuming, in disaggregated mode)
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED, timeout=1.0)
        finally:
            if stop_wait is not None and not stop_wait.done():
                stop_wait.cancel()

    async def produce_batch(self, task: Task, ctx: ProduceContext) -> None:
        if self.pending:
            raise RuntimeError(f"task {task.name!r}: {self.pending} rollout groups of the previous window are still "
                               f"in flight; drain() must run after every produce_batch()")
        await self._fill(task, ctx)

    async def produce_round(self, task: Task, ctx: ProduceContext) -> ProduceStatus:
        return await self._fill(task, ctx)


@hookimpl
def register_produce_strategies():
    return [SyncProduceStrategy, AsyncProduceStrategy]
