"""The produce-strategy contract: a strategy, the task it serves and the window it fills.

A strategy fills the replay buffer until its task has enough COMPLETED groups. Every finished
group goes through :meth:`ProduceStrategy.put_generated`: raw-reward stats, group filters
(FILTERED groups are discarded and replaced), FAILED groups discarded, the rest stored with
the task's staleness rule (:mod:`rlcli.produce.staleness`; it may expire the group).

Each spawned group is stored exactly once, by the asyncio task that produced it, whichever of
the producer, ``drain`` or a cancellation sees it finish. The built-in strategies are in
:mod:`rlcli.produce.strategies`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from pydantic import Field

from rlcli.agent_loops.base import run_group_isolated
from rlcli.component import CancelsJudging, Component, ComponentConfig, HasJudgePool
from rlcli.produce.replay_buffer import ReplayBuffer
from rlcli.produce.staleness import StalenessRule
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
    # over judged COMPLETED samples, filtered groups included; a list, summed exactly (math.fsum) when
    # read, because groups come back in the order they finish and a float sum depends on that order
    raw_rewards: list[float] = field(default_factory=list)
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
    #: Whether a colocated engine that can step in lockstep with the event loop (``rlcli.lockstep``)
    #: should, so that runs repeat exactly: requests that reach the engine while others decode (a
    #: multi-turn loop's continuation turns, dynamic sampling's replacement groups, async's
    #: over-sampled groups and weight-sync pause) otherwise join batches that depend on timing, and
    #: so do the engine's logprobs (and, with rollout IS, the loss). True for the built-in
    #: strategies; a strategy whose runs need not repeat may set it False.
    lockstep: ClassVar[bool] = True

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
        return StalenessRule.from_windows(self.sync_weights_interval, retryable=False)

    def model_expired(self, future_step: int, model_step: int) -> bool:
        """Would data for ``future_step`` made by policy ``model_step`` already be expired?"""
        return self.staleness_rule().model_expired(future_step, model_step)

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
        return self.put_generated(task, group, ctx)

    async def run_group(self, task: Task, group: Group) -> Group:
        """Roll out ``group`` with the task's agent loop; a loop that raises fails the samples it was
        running (FAILED, counted in ``agent_loop/errors``), never the run."""
        before = sum(len(s.response_ids) for s in group.samples)
        t0 = time.perf_counter()
        try:
            await run_group_isolated(task.agent_loop, group.samples)
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
                    st.raw_rewards.append(s.score)
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
