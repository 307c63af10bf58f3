"""Produce strategies: how many groups to roll out, and when, for one task.

A strategy fills the replay buffer until its task has enough COMPLETED groups. Every finished
group goes through :meth:`ProduceStrategy.put_generated`: raw-reward stats, group filters
(FILTERED groups are discarded and replaced), FAILED groups discarded, the rest stored with
the task's staleness rule (which may expire it).

* ``sync``: launch exactly the missing groups, wait, replace discarded ones (XTuner's
  SyncProduceStrategy; strict on-policy with ``sync_weights_interval: 1``).
* ``async``: over-sample, keep leftovers and paused partial responses across steps within a
  staleness bound, re-roll expired groups (tail batch), continue partial rollouts (XTuner's
  AsyncProduceStrategy, with the partial-rollout flag per task and ``tail_batch_max_tries``).

The ``async`` strategy serves both drivers of :class:`rlcli.manager.RolloutManager`:

* colocated - ``produce_batch`` fills the buffer for one step, then the manager pauses the
  backend and calls ``drain``: nothing stays in flight across steps;
* disaggregated - ``produce_round`` is called by the manager's background ``produce_loop`` once
  per future step, with in-flight groups kept across rounds; it returns a
  :class:`ProduceStatus` (``UPDATE_WEIGHT_AND_ABORT`` when a pause is requested,
  ``EXPIRED_BATCH`` when the producer would run further ahead of the served model than the
  staleness bound allows).

Each spawned group is stored exactly once, by the asyncio task that produced it, whichever of
the producer, ``drain`` or a cancellation sees it finish.

Staleness is counted in policy versions: a sample's staleness at consumer step ``t`` is
``t - (version of its oldest token) - 1``; the ``async`` strategy expires samples at
``stale_threshold = (max_staleness + 1) * sync_weights_interval``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from pydantic import Field

from rlcli import hookimpl
from rlcli.component import CancelsJudging, Component, ComponentConfig, HasJudgePool
from rlcli.replay_buffer import ReplayBuffer, StalenessRule
from rlcli.types import Group, Sample, Status

log = logging.getLogger(__name__)


class ProduceStatus(str, enum.Enum):
    """Outcome of a production round (and state of a disaggregated producer)."""

    NORMAL = "normal"
    UPDATE_WEIGHT_AND_ABORT = "update_weight_and_abort"  # a pause was requested (weight sync)
    EXPIRED_BATCH = "expired_batch"  # producing further ahead would exceed the staleness bound


@dataclass
class ProduceStats:
    """Counters of one production window (each in the unit its name says); read once and reset."""

    produced_samples: int = 0  # samples of every group that came back, discarded ones included
    new_tokens: int = 0  # tokens generated in this window (continuations count only their new tokens)
    raw_reward_sum: float = 0.0  # over judged COMPLETED samples, filtered groups included
    raw_reward_count: int = 0
    failed_samples: int = 0
    failed_groups: int = 0  # every member FAILED: discarded
    filtered_groups: int = 0
    expired_groups: int = 0  # expired at put or refresh (re-rolled later or discarded)
    aborted_groups: int = 0  # came back ABORTED (paused) and stored for continuation
    dropped_retry_groups: int = 0  # a member had been re-rolled tail_batch_max_tries times
    partial_resumed_samples: int = 0  # paused partial responses sent back to be continued
    rerolled_samples: int = 0  # samples restarted from scratch (expired, or paused without partial rollout)
    tail_batch_windows: int = 0  # production windows run in tail-batch mode
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
    """What a strategy needs to know about the window it produces for.

    Colocated: ``target`` is None and the goal is ``batch_size`` COMPLETED groups in the buffer.
    Disaggregated: the manager keeps one context per task and updates it live; the goal is
    ``consumed + COMPLETED in the buffer >= target`` (cumulative groups), and ``train_step`` is
    the consumer's next step.
    """

    batch_size: int  # this step's share of the task (also the base of the over-sample budget)
    train_step: int  # consumer step the data is for (staleness is measured at it)
    model_step: int  # policy version the backend is serving
    buffer: ReplayBuffer
    progress: Callable[[int], None] | None = None  # called with 1 per stored COMPLETED group
    target: int | None = None  # disaggregated: cumulative COMPLETED groups to reach
    consumed: int = 0  # disaggregated: groups of this task already taken by the trainer
    future_step: int | None = None  # disaggregated: the step being produced for
    stop: asyncio.Event | None = None  # disaggregated: set when a pause is requested

    @property
    def goal(self) -> int:
        return self.batch_size if self.target is None else self.target

    def available(self, task: str) -> int:
        return self.consumed + self.buffer.count(task, Status.COMPLETED)


class ProduceStrategyConfig(ComponentConfig):
    max_failed_groups: int = Field(
        64, gt=0, description="Stop the run when this many groups in a row fail (e.g. a judger that always raises).")
    max_filtered_groups: int = Field(
        1000, gt=0, description="Stop the run when this many groups in a row are filtered out (a filter that "
        "rejects everything would otherwise spin forever).")
    judge_grace_s: float = Field(
        10.0, ge=0, description="On a pause, judge calls still running get this long; then they are cancelled "
        "and their samples become ABORTED (re-judged later).")
    drain_timeout_s: float = Field(
        300.0, gt=0, description="On a pause, rollouts still running after this long are cancelled; their "
        "unfinished samples become ABORTED (kept for a retry).")


class ProduceStrategy(Component):
    """Base class of produce strategies."""

    Config: ClassVar[type[ProduceStrategyConfig]] = ProduceStrategyConfig

    def __init__(self, config: ProduceStrategyConfig, *, sync_weights_interval: int = 1):
        super().__init__(config)
        if sync_weights_interval <= 0:
            raise ValueError(f"sync_weights_interval must be positive, got {sync_weights_interval}")
        self.sync_weights_interval = sync_weights_interval
        self._failed_in_a_row = 0
        self._filtered_in_a_row = 0
        self._pending: dict[asyncio.Future, Group] = {}
        self._errors: list[BaseException] = []  # raised by finished group tasks, not yet re-raised

    # ------------------------------------------------------------------------------ staleness
    def staleness_rule(self) -> StalenessRule:
        """Sync strategies never keep data past its sync window and never retry expired groups."""
        return StalenessRule(stale_threshold=self.sync_weights_interval, retryable=False)

    @property
    def stale_threshold(self) -> int | None:
        return self.staleness_rule().stale_threshold

    def model_expired(self, future_step: int, model_step: int) -> bool:
        """Would data for ``future_step`` made by policy ``model_step`` already be expired?"""
        thr = self.stale_threshold
        return thr is not None and future_step - model_step - 1 >= thr

    # ------------------------------------------------------------------------------- driving
    @property
    def pending(self) -> int:
        """Groups in flight."""
        self._prune()
        return len(self._pending)

    async def produce_batch(self, task: Task, ctx: ProduceContext) -> None:
        """Colocated: fill the buffer until the task has ``ctx.batch_size`` COMPLETED groups."""
        raise NotImplementedError

    async def produce_round(self, task: Task, ctx: ProduceContext) -> ProduceStatus:
        """Disaggregated: one round of the background producer (see :class:`AsyncProduceStrategy`)."""
        raise NotImplementedError(
            f"produce strategy {self.name!r} has no background producer (disaggregated mode); use 'async'")

    async def drain(self, task: Task, ctx: ProduceContext) -> None:
        """After the backend is paused: wait for the groups in flight, which store themselves.

        Generation returns at once on a pause; judge calls still running get
        ``judge_grace_s`` more seconds, then are cancelled (their samples become ABORTED and are
        re-judged when the group is continued). Anything still running after
        ``drain_timeout_s`` is cancelled and kept as ABORTED. Raises the first error a group's
        task raised (e.g. too many failed groups in a row).
        """
        self._prune()
        if not self._pending:
            return
        pool = task.agent_loop.judge_pool if isinstance(task.agent_loop, HasJudgePool) else None
        start = time.monotonic()
        grace_end = start + self.config.judge_grace_s
        hard_end = start + max(self.config.drain_timeout_s, self.config.judge_grace_s)
        await asyncio.sleep(0)  # let results the pause just delivered reach their judge calls
        while True:
            self._prune()
            if not self._pending:
                break
            now = time.monotonic()
            if now >= hard_end:
                left = list(self._pending)
                log.warning("task %r: %d rollout groups still running %.0fs after the pause; cancelling them "
                            "(kept as ABORTED)", task.name, len(left), now - start)
                for f in left:
                    f.cancel()
                await asyncio.wait(left)
                break
            if isinstance(pool, CancelsJudging) and pool.pending:
                # judge calls in flight: they get what is left of the grace period, then are cancelled
                await pool.cancel_pending(max(0.0, grace_end - now))
            await asyncio.wait(list(self._pending), timeout=min(0.05, hard_end - now))
        self._raise_errors()

    def _prune(self) -> None:
        for f in [f for f in self._pending if f.done()]:
            del self._pending[f]

    def _raise_errors(self) -> None:
        if self._errors:
            err, self._errors = self._errors[0], []
            raise err

    def _on_done(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            self._errors.append(fut.exception())

    def _spawn(self, task: Task, group: Group, ctx: ProduceContext) -> None:
        fut = asyncio.ensure_future(self._run_and_put(task, group, ctx))
        fut.add_done_callback(self._on_done)
        self._pending[fut] = group

    async def _run_and_put(self, task: Task, group: Group, ctx: ProduceContext) -> Status | None:
        try:
            await self.run_group(task, group)
        except asyncio.CancelledError:
            _mark_interrupted(group)
            self.put_generated(task, group, ctx)  # kept for a retry, never lost
            raise
        except Exception as exc:  # a broken agent loop fails its samples, not the run
            log.exception("task %r: agent loop raised on group %d", task.name, group.group_id)
            reason = f"agent loop raised {type(exc).__name__}: {exc}"[:2000]
            for s in group.samples:
                if s.status != Status.COMPLETED or s.reward is None:
                    s.status, s.error, s.reward = Status.FAILED, reason, None
        return self.put_generated(task, group, ctx)

    async def run_group(self, task: Task, group: Group) -> Group:
        before = sum(len(s.response_ids) for s in group.samples)
        t0 = time.perf_counter()
        try:
            await task.agent_loop.run_group(group.samples)
        finally:
            task.stats.new_tokens += max(0, sum(len(s.response_ids) for s in group.samples) - before)
        task.stats.group_times.append(time.perf_counter() - t0)
        return group

    # -------------------------------------------------------------------------------- storing
    def put_generated(self, task: Task, group: Group, ctx: ProduceContext) -> Status | None:
        """Account for a finished group and store it; return its stored status (None: discarded)."""
        st = task.stats
        st.produced_samples += len(group.samples)
        status = group.status
        failed = [s for s in group.samples if s.status == Status.FAILED]
        st.failed_samples += len(failed)
        for s in failed[:1]:
            if s.error:
                st.errors.append(s.error)
                del st.errors[:-20]
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
                    self._filtered_in_a_row += 1
                    if self._filtered_in_a_row >= self.config.max_filtered_groups:
                        names = ", ".join(getattr(f, "name", type(f).__name__) for f in task.filters)
                        raise RuntimeError(
                            f"task {task.name!r}: {self._filtered_in_a_row} groups in a row were filtered out by "
                            f"the group filters ({names}); the filters reject everything (e.g. all_equal_rewards "
                            f"with prompt_repeat_k=1, or a task the model never solves)")
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
        if status == Status.COMPLETED:
            self._filtered_in_a_row = 0
        stored = ctx.buffer.put(group, consumer_step=ctx.train_step, rule=task.rule)
        if stored is None or stored == Status.EXPIRED:
            st.expired_groups += 1
        elif stored == Status.ABORTED:
            st.aborted_groups += 1
        elif stored == Status.COMPLETED and ctx.progress is not None:
            ctx.progress(1)
        return stored

    def prepare_retry(self, task: Task, group: Group, *, partial: bool) -> bool:
        """Make a group taken back from the buffer ready to roll out again; False: drop it.

        COMPLETED members are kept (the fresh siblings of an expired group, or members that
        finished before a pause). A paused (ABORTED) member with tokens is continued when
        ``partial`` (its judge call is simply redone if only judging was cut), else restarted
        from scratch. EXPIRED and FAILED members are restarted. Restarting a member that already
        produced something counts as a re-roll (``Sample.tries``).
        """
        restart: list[Sample] = []  # generated again from the prompt
        resume: list[Sample] = []  # continued from the tokens they hold
        for s in group.samples:
            if s.status == Status.COMPLETED:
                continue
            if s.status == Status.ABORTED and not s.response_ids:
                continue  # paused before its first token: nothing to continue or to throw away
            if s.status == Status.ABORTED and partial:
                resume.append(s)
            else:
                restart.append(s)
        if not self.allow_retry(task, group, restart):
            return False
        for s in restart:
            if _is_reroll(s):
                s.tries += 1
                task.stats.rerolled_samples += 1
            s.reset_response()
        for s in resume:
            s.resumes += 1
            task.stats.partial_resumed_samples += 1
        return True

    def allow_retry(self, task: Task, group: Group, restart: list[Sample]) -> bool:
        """Whether a group whose ``restart`` members are about to be re-rolled may be retried."""
        return True

    # ----------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        if self.pending:
            raise RuntimeError(f"cannot save produce strategy {self.name!r} while {self.pending} rollout groups "
                               f"are in flight")
        return {"failed_in_a_row": self._failed_in_a_row, "filtered_in_a_row": self._filtered_in_a_row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._failed_in_a_row = int(state.get("failed_in_a_row", 0))
        self._filtered_in_a_row = int(state.get("filtered_in_a_row", 0))


def _is_reroll(s: Sample) -> bool:
    """Restarting ``s`` throws work away (an expired response, paused tokens, a failed attempt)."""
    return s.status in (Status.EXPIRED, Status.FAILED) or bool(s.response_ids)


def _mark_interrupted(group: Group) -> None:
    """A rollout task was cancelled mid-way: what did not finish (or was not judged) is ABORTED."""
    for s in group.samples:
        unfinished = s.status not in (Status.COMPLETED, Status.FAILED, Status.FILTERED)
        unjudged = s.status == Status.COMPLETED and s.reward is None
        if unfinished or unjudged:
            s.status, s.finish_reason, s.reward = Status.ABORTED, "abort", None


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
        c, i = self.config, self.sync_weights_interval
        return StalenessRule(
            stale_threshold=(c.max_staleness + 1) * i,
            token_stale_threshold=None if c.max_token_staleness is None else (c.max_token_staleness + 1) * i,
            retryable=c.tail_batch_trigger_size >= 0,
        )

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
