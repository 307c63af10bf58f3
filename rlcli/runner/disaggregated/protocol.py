"""The commands train rank 0 sends the rollout ranks and the replies it waits for, in rank order
(the rollout side's command loop is :meth:`RolloutSide.run <rlcli.runner.disaggregated.rollout_side.RolloutSide.run>`),
and the best-effort report of a failure to a peer. Messages travel over :mod:`rlcli.runner.transport`."""

from __future__ import annotations

import logging
from typing import Any

from rlcli.produce import ProduceStatus
from rlcli.runner.transport import Channels, RemoteError, recv, send

log = logging.getLogger("rlcli")

_EXPIRED = ProduceStatus.EXPIRED_BATCH.value


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

    def send(self, i: int, msg: tuple) -> None:
        send(msg, self.ranks[i], self.ch.command)

    def send_all(self, msg: tuple) -> None:
        for i in range(len(self.ranks)):
            self.send(i, msg)

    def recv(self, i: int) -> Any:
        return recv(self.ranks[i], self.ch.reply)

    def request_all(self, msg: tuple) -> list[Any]:
        self.send_all(msg)
        return [self.recv(i) for i in range(len(self.ranks))]

    def pause(self) -> None:
        """``pause_produce`` everywhere; returns once every rank has drained what was in flight."""
        for ack in self.request_all(("pause",)):
            assert ack == "paused", ack

    def continue_(self, model_step: int) -> None:
        self.send_all(("continue", model_step))

    def stop(self) -> None:
        for ack in self.request_all(("stop",)):
            assert ack == "stopped", ack

