"""The ``process`` executor of :class:`~rlcli.judgers.pool.JudgePool`: worker processes fed in batches.

A worker (:mod:`rlcli.judgers.worker_process`) loads the judger once (it is pickled once, when
the pool is built), caps its memory at ``memory_limit_mb`` and answers calls one at a time, in
the order they were sent. Calls wait in one queue; a worker with nothing to do takes a batch
from its front (at most ``_MAX_BATCH``, about an equal share of the queue) and its *driver*, a
task on the event loop, reads the answers as they come and times the call that is running:

* a call that runs past ``timeout_s`` fails (timeout) and its worker is killed;
* a worker that dies (``os._exit``, a segfault, the OOM killer) fails the call it was running
  (crash);
* a call that hits the memory limit fails (memory) and its worker is replaced;
* the calls sent after a failed one were never started: they go back to the queue's front.

Hung calls time out side by side, not one after another: a call that has run for
:func:`~rlcli.judgers.calls._stuck_after` (``min(0.5 s, timeout_s / 10)``) makes its worker
*stuck*: the calls sent after it go back to the queue (the worker is told to skip them), and
while any worker is stuck new workers are started for the queued calls, up to ``max_workers``
processes in all. Workers are kept until the pool closes (or they fail); beyond ``workers``
they are spares, woken only while a worker is stuck.

Workers start on first use, off the event loop; their start-up time (at most
``_BOOT_TIMEOUT_S``) is not counted against the timeout. They are started with ``forkserver``
(``spawn`` where that is missing), never ``fork``; the forkserver imports the judger's module
before it forks them, so that starting one costs a fork, not the imports.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import pickle
import sys
import time
from typing import Any

from rlcli.judgers.calls import _clip, _Outcome, _stuck_after, _timed_out
from rlcli.judgers.worker_process import (  # noqa: F401 - _Proc, _exitcode, _exit_reason: imported from here
    _BOOT_TIMEOUT_S, _OOM_EXIT_CODE, _exit_reason, _exitcode, _Proc, _readable,
)
from rlcli.types import Sample

log = logging.getLogger(__name__)

_MAX_BATCH = 16
_PRELOADED = ["__main__", "rlcli.judgers.worker_process"]  # the forkserver imports these before forking


def _preload(ctx: Any, judger: Any) -> None:
    """Have the forkserver import the worker's code and ``judger``'s module before it forks workers,
    so that starting one costs a fork, not those imports (effective if it has not started yet)."""
    if ctx.get_start_method() != "forkserver":
        return
    module = type(judger).__module__
    if module not in _PRELOADED and module in sys.modules:
        _PRELOADED.append(module)
    ctx.set_forkserver_preload(list(_PRELOADED))


def _light(sample: Sample) -> Sample:
    """A shallow copy without the per-token lists: judgers get the text, the label and the metadata."""
    light = object.__new__(Sample)
    light.__dict__.update(sample.__dict__)
    light.logprobs, light.token_versions, light.response_mask = [], [], []
    return light


@dataclasses.dataclass(eq=False)
class _Call:
    sample: Sample  # the light copy that travels
    future: asyncio.Future  # its _Outcome
    worker: "_Worker | None" = None  # the worker it was last sent to

    def settle(self, outcome: _Outcome) -> None:
        fut = self.future
        if fut.done():
            return
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if fut.get_loop() is here:
            fut.set_result(outcome)
            return
        try:
            fut.get_loop().call_soon_threadsafe(lambda: fut.done() or fut.set_result(outcome))
        except RuntimeError:  # that caller's event loop is closed
            pass


@dataclasses.dataclass(eq=False)
class _Sent:
    id: int
    call: _Call
    handed_back: bool = False  # put back in the queue: this worker is to skip it


class _Worker:
    def __init__(self) -> None:
        self.proc: _Proc | None = None  # None until its process is started
        self.ready = False  # its process loaded the judger (a start cut short resumes waiting for it)
        self.sent: collections.deque[_Sent] = collections.deque()  # answered in this order
        self.head_since = 0.0  # when the first call in `sent` started (as seen from here)
        self.stuck = False
        self.dead = False
        self.driver: asyncio.Task | None = None
        self.next_id = 0


class _ProcessExecutor:
    """The part of :class:`~rlcli.judgers.pool.JudgePool` that judges samples in worker processes."""

    timeout_s: float
    workers: int
    max_workers: int
    memory_limit_mb: int | None
    _name: str
    _closed: bool
    _ctx: Any
    _judger_bytes: bytes
    _procs: list[_Proc]  # every worker process not yet reaped
    _live: list[_Worker]
    _queue: collections.deque[_Call]
    _init_error: str | None

    async def _run_process(self, sample: Sample) -> _Outcome:
        if self._init_error is not None:
            return _Outcome("error", self._init_error)
        call = _Call(_light(sample), asyncio.get_running_loop().create_future())
        self._queue.append(call)
        self._dispatch()
        try:
            return await call.future
        except asyncio.CancelledError:
            self._forget(call)
            raise

    # --------------------------------------------------------------------------- scheduling
    def _dispatch(self) -> None:
        """Set enough workers to work on the queued calls: ``workers`` of them, or while any is
        stuck every queued call its own, up to ``max_workers`` processes; idle ones first."""
        while self._queue and self._queue[0].future.done():
            self._queue.popleft()
        if self._closed or not self._queue:
            return
        loop = asyncio.get_running_loop()
        stuck = sum(w.stuck for w in self._live)
        target = self.max_workers - stuck if stuck else self.workers
        want = min(target - self._active(), len(self._queue))
        for w in self._live:
            if want <= 0:
                return
            if w.driver is None:
                w.driver = loop.create_task(self._drive(w))
                want -= 1
        for _ in range(min(want, self.max_workers - len(self._live))):
            w = _Worker()
            self._live.append(w)
            w.driver = loop.create_task(self._drive(w))

    def _active(self) -> int:
        """Workers starting or working that are not stuck (idle ones have no driver)."""
        return sum(1 for w in self._live if w.driver is not None and not w.stuck)

    def _take_batch(self) -> list[_Call]:
        n = min(_MAX_BATCH, -(-len(self._queue) // max(1, self._active())))
        batch: list[_Call] = []
        while self._queue and len(batch) < n:
            call = self._queue.popleft()
            if not call.future.done():
                batch.append(call)
        return batch

    def _hand_back(self, sent: list[_Sent]) -> None:
        """Put calls sent to a worker but not started back at the front of the queue, in order."""
        calls = [s.call for s in sent if not s.handed_back and not s.call.future.done()]
        for s in sent:
            s.handed_back = True
        self._queue.extendleft(reversed(calls))

    def _forget(self, call: _Call) -> None:
        """The caller gave up on ``call`` (a pause or ``close`` cancelled it)."""
        try:
            self._queue.remove(call)
            return
        except ValueError:
            pass
        w = call.worker
        if w is None or w.dead:
            return
        for i, s in enumerate(w.sent):
            if s.call is call and not s.handed_back:
                if i == 0:  # running: its worker's state is unknown
                    self._discard(w)
                    self._dispatch()
                else:
                    s.handed_back = True
                    _send(w, ("skip", [s.id]))
                return

    def _discard(self, w: _Worker) -> None:
        """Kill ``w`` and hand its unanswered calls back; its driver (if any) closes the pipe."""
        if w.dead:
            return
        w.dead = True
        if w in self._live:
            self._live.remove(w)
        self._hand_back(list(w.sent))
        w.sent.clear()
        if w.proc is not None:
            w.proc.kill()
            if w.driver is None:
                w.proc.close_pipe()

    # ------------------------------------------------------------------------------ a driver
    async def _drive(self, w: _Worker) -> None:
        """Start ``w`` if needed, then feed it batches and read its answers while there is work."""
        try:
            if not w.ready and not await self._start(w):
                return
            while not w.dead and (w.sent or self._feed(w)):
                await self._read(w)
        except asyncio.CancelledError:
            if w.sent:
                self._discard(w)
            raise
        except Exception as exc:  # a bug here must fail these calls, not hang them
            log.exception("judger %s: judge executor error", self._name)
            reason = _clip(f"judge executor error: {type(exc).__name__}: {exc}")
            for s in w.sent:
                s.call.settle(_Outcome("error", reason))
            self._discard(w)
        finally:
            w.driver = None
            if w.dead and w.proc is not None:
                w.proc.close_pipe()

    def _feed(self, w: _Worker) -> bool:
        """Send ``w`` its next batch; False when there is none (it then waits, idle, to be woken)."""
        assert w.proc is not None
        w.stuck = False
        while True:
            batch = self._take_batch()
            if not batch:
                return False
            if not w.proc.alive():  # died while idle: no call is to blame
                self._queue.extendleft(reversed(batch))
                self._discard(w)
                self._dispatch()
                return False
            items = []
            for call in self._encodable(batch):
                call.worker = w
                w.sent.append(_Sent(w.next_id, call))
                items.append((w.next_id, call.sample.response, call.sample.label, call.sample))
                w.next_id += 1
            if items:
                break
        w.head_since = time.monotonic()
        if _send(w, ("calls", items)) is None:  # its pipe broke: it died before starting any of them
            self._discard(w)
            self._dispatch()
            return False
        return True

    def _encodable(self, batch: list[_Call]) -> list[_Call]:
        """``batch`` less the calls whose sample cannot be pickled (those fail here)."""
        try:
            pickle.dumps([(c.sample.label, c.sample) for c in batch], protocol=pickle.HIGHEST_PROTOCOL)
            return batch
        except Exception:
            pass
        ok = []
        for c in batch:
            try:
                pickle.dumps((c.sample.label, c.sample), protocol=pickle.HIGHEST_PROTOCOL)
                ok.append(c)
            except Exception as exc:
                c.settle(_Outcome("error", _clip(
                    f"could not send the sample to the judger worker: {type(exc).__name__}: {exc}")))
        return ok

    async def _read(self, w: _Worker) -> None:
        """Wait for ``w``'s answers, the running call's timeout, or the moment it counts as stuck."""
        assert w.proc is not None
        conn = w.proc.conn
        deadline = w.head_since + self.timeout_s
        wake = deadline if w.stuck else min(deadline, w.head_since + _stuck_after(self.timeout_s))
        try:
            await _readable(conn, max(0.0, wake - time.monotonic()))
        except asyncio.TimeoutError:
            if w.dead:
                return
            if not conn.poll():  # no answer waiting to be read (the event loop may have been busy)
                self._timed_out(w) if time.monotonic() >= deadline else self._mark_stuck(w)
                return
        while not w.dead:
            try:
                reply = conn.recv()
            except (EOFError, OSError):
                await self._crashed(w)
                return
            self._answered(w, reply)
            if w.dead or not w.sent or not conn.poll():
                return

    def _answered(self, w: _Worker, reply: tuple) -> None:
        call_id, kind, value = reply
        if not w.sent or w.sent[0].id != call_id:  # cannot happen with in-order answers; be safe
            log.error("judger %s: a worker answered out of order; replacing it", self._name)
            self._discard(w)
            self._dispatch()
            return
        s = w.sent.popleft()
        w.head_since = time.monotonic()
        if kind == "skipped":
            return
        if s.handed_back:  # it ran here after all (the skip came too late): the first answer wins
            try:
                self._queue.remove(s.call)
            except ValueError:
                pass
        if kind == "memory":
            s.call.settle(_Outcome("memory", self._memory_reason("MemoryError in the call")))
            self._discard(w)
            self._dispatch()
            return
        s.call.settle(_Outcome("ok", value) if kind == "ok" else _Outcome("error", value))

    def _mark_stuck(self, w: _Worker) -> None:
        w.stuck = True
        rest = [s for s in list(w.sent)[1:] if not s.handed_back]
        if rest:
            self._hand_back(rest)
            _send(w, ("skip", [s.id for s in rest]))
        self._dispatch()

    def _timed_out(self, w: _Worker) -> None:
        head = w.sent[0]
        if not head.handed_back:
            head.call.settle(_timed_out(self.timeout_s))
        self._discard(w)
        self._dispatch()

    async def _crashed(self, w: _Worker) -> None:
        assert w.proc is not None
        code = await _exitcode(w.proc)
        if w.dead or self._closed:  # killed by us meanwhile
            return
        if code == _OOM_EXIT_CODE:
            outcome = _Outcome("memory", self._memory_reason("its worker process exited on a MemoryError"))
        else:
            outcome = _Outcome("crash", _exit_reason(code))
        if w.sent and not w.sent[0].handed_back:
            w.sent[0].call.settle(outcome)
        self._discard(w)
        self._dispatch()

    def _memory_reason(self, what: str) -> str:
        mb = self.memory_limit_mb
        head = f"judger exceeded its memory limit (memory_limit_mb: {mb})" if mb else "judger ran out of memory"
        return f"{head}: {what}; the worker process was replaced"

    # ----------------------------------------------------------------------------- start-up
    async def _start(self, w: _Worker) -> bool:
        """Start ``w``'s process (or go on waiting for it to load the judger); False (and one
        queued call failed with the reason) if it cannot."""
        if w.proc is None:
            self._procs = [p for p in self._procs if not p.reap(0.0)]
            starting = asyncio.get_running_loop().run_in_executor(
                None, _Proc, self._ctx, self._judger_bytes, self.memory_limit_mb)
            try:
                w.proc = await asyncio.shield(starting)
            except asyncio.CancelledError:
                starting.add_done_callback(_kill_started)
                self._discard(w)
                raise
            except Exception as exc:
                return self._not_started(w, f"judger worker process failed to start: {type(exc).__name__}: {exc}")
            self._procs.append(w.proc)
        try:
            await _readable(w.proc.conn, _BOOT_TIMEOUT_S)
            kind, value = w.proc.conn.recv()
        except asyncio.TimeoutError:
            return self._not_started(w, f"judger worker process did not start within {_BOOT_TIMEOUT_S:g}s")
        except (EOFError, ConnectionError, OSError):
            code = await _exitcode(w.proc)
            return self._not_started(w, f"judger worker process failed to start: {_exit_reason(code)}")
        if kind == "ready":
            w.ready = True
            return True
        if "MemoryError" in str(value) and self.memory_limit_mb:
            value = f"{value} (memory_limit_mb: {self.memory_limit_mb} is too small to load it)"
        self._init_error = _clip(f"judger {self._name!r} could not be loaded in a worker process: {value}")
        log.error("%s", self._init_error)
        while self._queue:
            self._queue.popleft().settle(_Outcome("error", self._init_error))
        self._discard(w)
        return False

    def _not_started(self, w: _Worker, reason: str) -> bool:
        log.warning("judger %s: %s", self._name, reason)
        if self._queue:  # one call fails for it, so that a worker that never starts cannot stall the rest
            self._queue.popleft().settle(_Outcome("error", reason))
        self._discard(w)
        self._dispatch()
        return False

    def _close_processes(self) -> None:
        """Kill every worker (hung ones too) and reap them."""
        for w in list(self._live):
            self._discard(w)
        self._queue.clear()
        for p in self._procs:
            p.kill()
        deadline = time.monotonic() + 2.0
        self._procs = [p for p in self._procs if not p.reap(max(0.0, deadline - time.monotonic()))]


def _send(w: _Worker, msg: Any) -> int | None:
    """Send ``msg`` to ``w``'s process; None if its pipe is broken (its death is seen when reading)."""
    assert w.proc is not None
    try:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        w.proc.conn.send_bytes(data)
        return len(data)
    except OSError:
        return None


def _kill_started(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is None:
        proc = fut.result()
        proc.kill()
        proc.close_pipe()
        proc.reap(1.0)
