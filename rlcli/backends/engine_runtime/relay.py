"""The requests' way between the callers' event loops and the engine thread: :class:`Relay`.

A call handed from one thread's event loop to another's wakes the other loop through its self-pipe
(``call_soon_threadsafe``): a socket write that releases the GIL, so the two threads trade the GIL
once per call. One call per request (``run_coroutine_threadsafe`` there, its result back by
``wrap_future``) made a round of 512 requests cost 512 such hand-overs each way. The relay hands
over what one loop turn produced at once: the requests a caller's loop made in one turn go to the
engine loop in one call, and the results the engine loop finished in one turn go back to each
caller's loop in one call (``benchmarks/plugin_host_overhead.py``, 2-core CPU: the last request
reached the engine 22.5-27.2 ms into the round before, 14.8-18.9 ms after).

A request made just before ``pause()``/``sleep()`` on the caller's thread reaches the engine
after it, at the end of the caller's turn: a pause then answers it "abort", a sleep lets it wait
for ``wake_up`` (as a request made while asleep waits).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Coroutine

from rlcli.backends.engine_runtime.loop import EngineLoop


class EngineStopped(RuntimeError):
    """The engine thread stopped before it could take the call."""


@dataclass(eq=False)
class _Call:
    make: Callable[[], Coroutine]  # the coroutine to run on the engine loop
    result: asyncio.Future  # on the caller's loop
    caller: asyncio.AbstractEventLoop
    task: asyncio.Future | None = None  # its task on the engine loop, once started
    cancelled: bool = False  # the caller stopped waiting (set on the caller's thread)


class Relay:
    """Runs coroutines on ``engine``'s loop for callers on other event loops, one hand-over per
    loop turn each way. A caller cancelled while waiting cancels its coroutine's task."""

    def __init__(self, engine: EngineLoop):
        self._engine = engine
        self._outgoing: dict[asyncio.AbstractEventLoop, list[_Call]] = {}  # per caller loop, its own thread only
        self._returning: list[_Call] = []  # the engine thread only

    async def run(self, make: Callable[[], Coroutine]) -> Any:
        """``await make()`` on the engine loop; raises :class:`EngineStopped` if the engine thread
        has stopped (``make`` is then not called)."""
        caller = asyncio.get_running_loop()
        call = _Call(make, caller.create_future(), caller)
        batch = self._outgoing.get(caller)
        if batch is None:
            batch = self._outgoing[caller] = []
            caller.call_soon(self._send, caller)  # after the other calls this turn makes
        batch.append(call)
        try:
            return await call.result
        except asyncio.CancelledError:
            call.cancelled = True
            task = call.task  # read after the flag: _start sets the task, then reads the flag
            if task is not None:
                with contextlib.suppress(RuntimeError):  # the engine loop is closed: nothing runs
                    self._engine.loop.call_soon_threadsafe(task.cancel)
            raise

    # -- on the caller's loop
    def _send(self, caller: asyncio.AbstractEventLoop) -> None:
        batch = [c for c in self._outgoing.pop(caller, []) if not c.result.done()]  # not cancelled meanwhile
        if not batch:
            return
        try:
            if not self._engine.alive:
                raise RuntimeError
            self._engine.loop.call_soon_threadsafe(self._start, batch)
        except RuntimeError:
            stopped = EngineStopped(f"the {self._engine.name} engine thread has stopped")
            for call in batch:
                if not call.result.done():
                    call.result.set_exception(stopped)

    @staticmethod
    def _resolve(calls: list[_Call]) -> None:
        for call in calls:
            if call.result.done():  # the caller was cancelled
                continue
            task = call.task
            if task.cancelled():
                call.result.cancel()
            elif (exc := task.exception()) is not None:
                call.result.set_exception(exc)
            else:
                call.result.set_result(task.result())

    # -- on the engine loop
    def _start(self, batch: list[_Call]) -> None:
        loop = asyncio.get_running_loop()
        for call in batch:
            if call.cancelled or call.result.done():  # the caller stopped waiting (read across threads)
                continue
            try:
                task = loop.create_task(call.make())
            except BaseException as exc:  # noqa: BLE001 - the caller gets it; the batch's others still start
                task = loop.create_future()
                task.set_exception(exc)
            call.task = task
            task.add_done_callback(lambda _t, call=call: self._finished(call))
            if call.cancelled:  # cancelled meanwhile, before it saw the task
                task.cancel()

    def _finished(self, call: _Call) -> None:
        if not self._returning:
            asyncio.get_running_loop().call_soon(self._return)  # after the other tasks ending this turn
        self._returning.append(call)

    def _return(self) -> None:
        calls, self._returning = self._returning, []
        by_caller: dict[asyncio.AbstractEventLoop, list[_Call]] = {}
        for call in calls:
            by_caller.setdefault(call.caller, []).append(call)
        for caller, mine in by_caller.items():
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits
                caller.call_soon_threadsafe(self._resolve, mine)
