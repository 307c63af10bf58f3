"""The messages of a disaggregated run, one frozen dataclass per kind, and the two ends that use them.

Train rank 0 sends the rollout ranks **commands** (on the ``command`` group) and waits for their
**replies** (on the ``reply`` group), in rank order; each command names the reply kind it waits
for (``reply``, ``None`` for none). The rollout side's command loop is :meth:`RolloutSide.run
<rlcli.runner.disaggregated.rollout_side.RolloutSide.run>`. The other train ranks follow **orders**
broadcast by train rank 0 on the ``train`` group (:meth:`TrainSide._follow
<rlcli.runner.disaggregated.train_side.TrainSide._follow>`); an order that is also a command
(:class:`SyncWeights`, :class:`SaveCheckpoint`, :class:`Stop`) is the same class.

Command -> reply, and what the rollout rank does:

* :class:`GetBatch` -> :class:`BatchReply`: its groups of a step (``get_batch``);
* :class:`PauseProduce` -> :class:`Paused`: pauses production once what was in flight has drained;
* :class:`ContinueProduce` (no reply): resumes production for a model step;
* :class:`SyncWeights` (no reply): receives the weight buckets on the ``weights`` group;
* :class:`Evaluate` -> :class:`EvalReply`: evaluates its share of the eval prompts;
* :class:`SaveCheckpoint` (no reply): joins the job-wide checkpoint save;
* :class:`Stop` -> :class:`Stopped`: shuts its producer down and leaves the loop.

Orders to the other train ranks: :class:`TrainStep` (then their share of the sequences, scattered),
:class:`SyncWeights` (gather the weights with train rank 0), :class:`SaveCheckpoint`,
:class:`ExportHF`, :class:`Stop`.

Messages travel pickled over :mod:`rlcli.runner.transport` (every rank runs this same code, so the
classes live at module level); a failing rank sends a :class:`~rlcli.runner.transport.RemoteError`
instead (:func:`_report`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, Union

from rlcli.produce import ProduceStatus
from rlcli.runner.transport import Channels, RemoteError, recv, send
from rlcli.types import Group, Sample

log = logging.getLogger("rlcli")


# ------------------------------------------------------------------------------ replies
@dataclass(frozen=True)
class BatchReply:
    """A rollout rank's groups of one step, the status of its production round and its metrics."""

    groups: list[Group]
    status: ProduceStatus
    metrics: dict[str, float]

    @property
    def expired(self) -> bool:
        """The producer reached its staleness bound: it waits for newer weights (a sync ends the step)."""
        return self.status == ProduceStatus.EXPIRED_BATCH

    @property
    def waits_for_weights(self) -> bool:
        """An empty EXPIRED_BATCH answer: no groups until newer weights arrive; ask again after a sync."""
        return self.expired and not self.groups


@dataclass(frozen=True)
class Paused:
    """Production is paused; nothing is in flight."""


@dataclass(frozen=True)
class EvalReply:
    """A rollout rank's evaluated share of the eval prompts and its eval judges' and engine's counters."""

    samples: list[Sample]
    judge_stats: dict[str, float]


@dataclass(frozen=True)
class Stopped:
    """The producer is shut down; the rank leaves its command loop."""


# ----------------------------------------------------------------------------- commands
@dataclass(frozen=True)
class Command:
    """What train rank 0 sends a rollout rank; ``reply`` is the kind of answer it then waits for."""

    reply: ClassVar[type | None] = None  # None: the command is not answered


@dataclass(frozen=True)
class GetBatch(Command):
    """Answer this rank's groups of ``step``."""

    step: int
    reply: ClassVar[type | None] = BatchReply


@dataclass(frozen=True)
class PauseProduce(Command):
    """Pause production (before a weight sync, evaluation or checkpoint)."""

    reply: ClassVar[type | None] = Paused


@dataclass(frozen=True)
class ContinueProduce(Command):
    """Resume production; the replica now serves the policy of ``model_step``."""

    model_step: int


@dataclass(frozen=True)
class SyncWeights(Command):
    """A weight update to policy ``version`` follows on the ``weights`` group (rollout ranks receive
    it; as an order, the other train ranks take part in gathering it)."""

    version: int


@dataclass(frozen=True)
class Evaluate(Command):
    """Evaluate this rank's share of the eval prompts at ``step`` (production is paused)."""

    step: int
    reply: ClassVar[type | None] = EvalReply


@dataclass(frozen=True)
class SaveCheckpoint(Command):
    """Join the job-wide checkpoint save of ``step`` (production is paused)."""

    step: int


@dataclass(frozen=True)
class Stop(Command):
    """The run is over: shut down and leave the loop."""

    reply: ClassVar[type | None] = Stopped


# ------------------------------------------------------------------- orders (train group)
@dataclass(frozen=True)
class TrainStep:
    """Train on the share of the step's sequences scattered next."""


@dataclass(frozen=True)
class ExportHF:
    """Take part in the HF export of ``step``."""

    step: int


Order = Union[TrainStep, SyncWeights, SaveCheckpoint, ExportHF, Stop]


# ------------------------------------------------------------------------------ the ends
R = TypeVar("R")


def expect(reply: Any, kind: type[R], rank: int) -> R:
    """``reply`` if it is a ``kind``; otherwise an error naming what rank ``rank`` sent instead."""
    if not isinstance(reply, kind):
        raise RuntimeError(f"rollout rank {rank} answered {reply!r}, expected a {kind.__name__}")
    return reply


def _report(exc: BaseException, rank: int, role: str, peers: list[tuple[int, Any]], timeout_s: float = 5.0) -> None:
    """Best effort: send a :class:`RemoteError` to each peer, waiting at most ``timeout_s`` for each."""
    import traceback

    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: just go
        return
    err = RemoteError(rank, role, f"{type(exc).__name__}: {exc}",
                      "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    for peer, group in peers:
        try:
            send(err, peer, group, timeout_s=timeout_s)
        except Exception:  # noqa: BLE001 - the peer is gone or busy; the launcher stops it anyway
            log.debug("could not report the failure to rank %d", peer, exc_info=True)


class _RolloutClient:
    """Train rank 0's handle on the rollout ranks (commands out, replies in, in rank order)."""

    def __init__(self, channels: Channels):
        self.ch = channels
        self.ranks = channels.placement.rollout

    def __len__(self) -> int:
        return len(self.ranks)

    def send(self, i: int, msg: Command) -> None:
        send(msg, self.ranks[i], self.ch.command)

    def send_all(self, msg: Command) -> None:
        for i in range(len(self.ranks)):
            self.send(i, msg)

    def recv(self, i: int, kind: type[R]) -> R:
        """Rollout rank ``i``'s next reply, which must be a ``kind``."""
        return expect(recv(self.ranks[i], self.ch.reply), kind, self.ranks[i])

    def request_all(self, msg: Command) -> list[Any]:
        """Send ``msg`` to every rollout rank, then their replies (of the kind ``msg`` names), in rank order."""
        self.send_all(msg)
        return [self.recv(i, msg.reply) for i in range(len(self.ranks))]

    def pause(self) -> None:
        """``pause_produce`` everywhere; returns once every rank has drained what was in flight."""
        self.request_all(PauseProduce())

    def continue_(self, model_step: int) -> None:
        self.send_all(ContinueProduce(model_step))

    def stop(self) -> None:
        self.request_all(Stop())
