"""The ``thread`` executor of :class:`~rlcli.judgers.pool.JudgePool`: a pool of daemon threads.

The timeout is measured from when a worker picks the call up. A thread cannot be killed, so a
call that runs past :func:`~rlcli.judgers.calls._stuck_after` (``min(0.5 s, timeout_s / 10)``),
times out or is cancelled leaves its thread running: that thread is *retired* (it exits when
the call eventually returns) and a replacement worker is started, so capacity is kept and hung
calls time out side by side. At most ``max_hung_threads`` retired threads are replaced; beyond
that the pool runs with fewer workers until they return, and a call that finds no free worker
within ``timeout_s`` times out instead of waiting for them. Daemon threads, unlike a
``ThreadPoolExecutor``'s, never block interpreter exit.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

from rlcli.judgers.calls import _Abort, _call_judger, _describe_exception, _Outcome, _stuck_after, _timed_out
from rlcli.types import Sample

log = logging.getLogger(__name__)


class _Job:
    __slots__ = ("fn", "args", "future", "on_start", "thread")

    def __init__(self, fn: Callable[..., Any], args: tuple, on_start: Callable[[], None]):
        self.fn, self.args, self.on_start = fn, args, on_start
        self.future: Future = Future()
        self.thread: _Worker | None = None


class _Worker(threading.Thread):
    def __init__(self, pool: "_ThreadWorkers", index: int):
        super().__init__(name=f"rlcli-judge-{index}", daemon=True)
        self.pool = pool
        self.retired = False

    def run(self) -> None:
        while True:
            job = self.pool.jobs.get()
            if job is None:
                return
            job.thread = self  # before RUNNING, so that abandon() always finds the running thread
            if not job.future.set_running_or_notify_cancel():
                job.thread = None
                continue  # cancelled while queued
            try:
                job.on_start()
            except Exception:  # the event loop is gone; still run so the future resolves
                pass
            try:
                job.future.set_result(job.fn(*job.args))
            except BaseException as exc:  # noqa: BLE001 - a judger must never kill its worker
                job.future.set_exception(exc)
            with self.pool.lock:
                job.thread = None
                retired = self.retired
            if retired:
                self.pool.retired_done(self)
                return


class _ThreadWorkers:
    """Daemon worker threads pulling jobs from one queue; hung workers are retired and replaced."""

    def __init__(self, workers: int, max_hung: int):
        self.size, self.max_hung = workers, max_hung
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.active: set[_Worker] = set()
        self.hung: set[_Worker] = set()
        self.started = 0
        self.closed = False

    def _spawn(self) -> None:
        w = _Worker(self, self.started)
        self.started += 1
        self.active.add(w)
        w.start()

    def _top_up(self) -> None:
        """Keep ``size`` live workers, but never more than ``size + max_hung`` threads in all."""
        while (not self.closed and len(self.active) < self.size
               and len(self.active) + len(self.hung) < self.size + self.max_hung):
            self._spawn()

    def submit(self, job: _Job) -> None:
        with self.lock:
            if self.closed:
                raise _Abort("judge pool is closed")
            self._top_up()
        self.jobs.put(job)

    def abandon(self, job: _Job) -> None:
        """The caller gave up on ``job`` (timeout or cancellation); keep the pool's capacity."""
        if job.future.cancel():
            return  # still queued: it will never run
        with self.lock:
            w = job.thread
            if w is None or w.retired or w not in self.active:
                return  # already finished in the meantime
            w.retired = True
            self.active.discard(w)
            self.hung.add(w)
            self._top_up()
            if len(self.active) < self.size and not self.closed:
                log.warning(
                    "judger: %d judge threads are stuck (max_hung_threads=%d); running with %d of %d workers "
                    "until they return", len(self.hung), self.max_hung, len(self.active), self.size,
                )

    def starved(self) -> bool:
        """Fewer workers than ``size`` and no replacement allowed: a queued call may never start."""
        with self.lock:
            return len(self.active) < self.size

    def retired_done(self, w: _Worker) -> None:
        with self.lock:
            self.hung.discard(w)
            self._top_up()  # capacity lost beyond max_hung comes back when a stuck thread returns

    def close(self) -> None:
        with self.lock:
            self.closed = True
            n = len(self.active)
            self.active.clear()
        for _ in range(n):
            self.jobs.put(None)


class _ThreadExecutor:
    """The part of :class:`~rlcli.judgers.pool.JudgePool` that judges a sample in a worker thread."""

    judger: Any
    timeout_s: float
    _threads: _ThreadWorkers | None

    async def _run_thread(self, sample: Sample) -> _Outcome:
        assert self._threads is not None
        loop = asyncio.get_running_loop()
        started = loop.create_future()

        def on_start() -> None:
            loop.call_soon_threadsafe(lambda: started.done() or started.set_result(None))

        job = _Job(_call_judger, (self.judger, sample.response, sample.label, sample), on_start)
        self._threads.submit(job)
        done = asyncio.wrap_future(job.future)
        done.add_done_callback(_consume)  # a result that arrives after we gave up is dropped quietly
        try:
            if not await self._wait_for_a_thread(job, started, done):
                return _Outcome("timeout", (
                    f"judger timeout: no judge thread became free within {self.timeout_s}s ({len(self._threads.hung)} "
                    f"threads are stuck in earlier calls; max_hung_threads={self._threads.max_hung})"))
            # the call itself is timed; past stuck_after its thread is replaced (retired) already
            await asyncio.wait([done], timeout=min(_stuck_after(self.timeout_s), self.timeout_s))
            if not done.done():
                self._threads.abandon(job)
                await asyncio.wait([done], timeout=self.timeout_s - _stuck_after(self.timeout_s))
            if not done.done():
                return _timed_out(self.timeout_s)
        except asyncio.CancelledError:
            self._threads.abandon(job)
            raise
        finally:
            if not started.done():
                started.cancel()
        exc = done.exception()
        return _Outcome("error", _describe_exception(exc)) if exc is not None else _Outcome("ok", done.result())

    async def _wait_for_a_thread(self, job: _Job, started: asyncio.Future, done: asyncio.Future) -> bool:
        """Wait (untimed) for a worker to pick ``job`` up; False if it cannot be started within
        ``timeout_s`` because every worker is stuck (then it never will be)."""
        assert self._threads is not None
        while True:
            await asyncio.wait([started, done], timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if started.done() or done.done():
                return True
            if self._threads.starved() and job.future.cancel():  # still queued: it will never run
                return False


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()
