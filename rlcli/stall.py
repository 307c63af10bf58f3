"""A watchdog on the rollout's event loop: a rollout that stops moving says where, instead of
hanging without a word.

Two things stop a rollout without raising anything: code that blocks the event loop's thread (a
judger, agent loop or tool doing synchronous I/O, ``time.sleep`` or a long computation on the
loop), and an ``await`` that never returns (a tool server that never answers, a request sent
without a timeout). While the loop runs, a :class:`StallWatchdog` thread checks it every few
seconds:

* **blocked**: the loop has not taken a turn for ``blocked_s``. A warning names the code its
  thread is in (the innermost frames), and another says when it runs again.
* **no progress**: the loop runs, but no group has finished (:func:`progressed`) for ``idle_s``. A
  warning lists where the loop's tasks are waiting, grouped by the innermost line of each task's
  chain of awaits, and it repeats every ``idle_s`` while nothing finishes. A long generation is
  progress the watchdog cannot see, so this one says where things wait, not that they are stuck.

Neither stops the run. ``agent_loop.timeout_s`` fails a group that takes too long
(:func:`rlcli.agent_loops.base.run_group_isolated`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any

__all__ = ["StallWatchdog", "progressed"]

log = logging.getLogger(__name__)

BLOCKED_S = 30.0  # a loop that took no turn this long is blocked
IDLE_S = 600.0  # no group finished this long: say where the tasks wait
_ASYNCIO_DIR = os.path.dirname(asyncio.__file__)


class _Progress:
    count = 0


def progressed() -> None:
    """Count one finished unit of rollout work (a group run by its agent loop)."""
    _Progress.count += 1


def _innermost_await(coro: Any) -> str | None:
    """``file:line in function`` of the innermost frame (outside asyncio) of a coroutine's chain of awaits."""
    where = None
    seen = 0
    while coro is not None and seen < 64:
        seen += 1
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None and not frame.f_code.co_filename.startswith(_ASYNCIO_DIR):
            where = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
    return where


def where_tasks_wait(loop: asyncio.AbstractEventLoop, top: int = 6) -> list[tuple[int, str]]:
    """``(count, place)`` for the places the loop's unfinished tasks wait at, most first. Call it
    on the loop's thread."""
    places = collections.Counter(
        _innermost_await(t.get_coro()) or "(unknown)" for t in asyncio.all_tasks(loop) if not t.done())
    return [(n, place) for place, n in places.most_common(top)]


class StallWatchdog:
    """Watch ``loop`` (run by some thread, now and then) from a daemon thread of its own; see the
    module's docstring. ``name`` is how the warnings call the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str = "rollout", *, blocked_s: float | None = None,
                 idle_s: float | None = None):
        self.loop, self.name = loop, name
        self.blocked_s = BLOCKED_S if blocked_s is None else blocked_s
        self.idle_s = IDLE_S if idle_s is None else idle_s
        self.tick_s = max(0.05, min(5.0, self.blocked_s / 4, self.idle_s / 4))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"rlcli-watchdog-{name}", daemon=True)
        self._loop_thread: int | None = None
        self._beat_sent: float | None = None  # when the pending beat was scheduled
        self._blocked_since: float | None = None  # set once the blocked warning went out
        self._progress = (_Progress.count, time.monotonic())

    def start(self) -> "StallWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    # -- on the watchdog's thread
    def _watch(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self._check(time.monotonic())
            except Exception:  # noqa: BLE001 - the watchdog never takes the run down
                log.debug("stall watchdog check failed", exc_info=True)

    def _check(self, now: float) -> None:
        if self.loop.is_closed() or not self.loop.is_running():  # between phases: nothing to watch
            self._beat_sent, self._progress = None, (_Progress.count, now)
            return
        if self._beat_sent is None:
            self._beat_sent = now
            self.loop.call_soon_threadsafe(self._beat)
        elif self._blocked_since is None and now - self._beat_sent >= self.blocked_s:
            self._blocked_since = self._beat_sent
            log.warning("the %s event loop has not run for %.0f s: its thread is in\n%s\nA judger, agent loop or "
                        "tool that blocks the loop (synchronous I/O, time.sleep, a long computation) stops every "
                        "rollout: await it, or run it off the loop (asyncio.to_thread)",
                        self.name, now - self._beat_sent, self._loop_stack())
        count, since = self._progress
        if _Progress.count != count:
            self._progress = (_Progress.count, now)
        elif now - since >= self.idle_s and self._blocked_since is None:
            self._progress = (count, now)  # say it again after another idle_s
            self.loop.call_soon_threadsafe(self._report_waits, now - since)

    def _loop_stack(self) -> str:
        frame = sys._current_frames().get(self._loop_thread) if self._loop_thread is not None else None
        if frame is None:
            return "  (unknown: the loop has not run since the watchdog started)"
        return "".join(traceback.format_stack(frame)[-6:]).rstrip()

    # -- on the loop's thread
    def _beat(self) -> None:
        self._loop_thread = threading.get_ident()
        if self._blocked_since is not None:
            log.warning("the %s event loop runs again, after %.0f s blocked", self.name,
                        time.monotonic() - self._blocked_since)
            self._blocked_since = None
        self._beat_sent = None

    def _report_waits(self, idle: float) -> None:
        waits = where_tasks_wait(self.loop)
        if not waits:
            return
        lines = "\n".join(f"  {n} task(s) at {place}" for n, place in waits)
        log.warning("no %s group has finished for %.0f s; the event loop's tasks wait at\n%s\n(a long generation "
                    "is normal; an await that never returns stalls the run: agent_loop.timeout_s fails such groups)",
                    self.name, idle, lines)
