"""The ``process`` executor of :class:`~rlcli.judgers.pool.JudgePool`: a pool of worker processes.

Each worker runs one call at a time. The judger is pickled once when the pool is built and
loaded once per worker (:func:`_process_main`, the process target), never per call. A worker
that times out is killed and replaced; a worker that dies (``os._exit``, a segfault, the OOM
killer) fails only the sample it was judging. Workers start on first use, off the event loop;
their start-up time (at most ``_BOOT_TIMEOUT_S``) is not counted against the timeout. A worker
exits by itself when the run's process is gone.

The workers sit in :class:`_Slots`, one per allowed concurrent call; an empty slot holds
``None`` until a worker is started in it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import pickle
import signal
import threading
import time
from typing import Any

from rlcli.judgers.calls import _Abort, _call_judger, _clip, _describe_exception, _Outcome, _timed_out
from rlcli.types import Sample

log = logging.getLogger(__name__)

_BOOT_TIMEOUT_S = 120.0  # a worker process must be ready within this (not counted in timeout_s)


def _process_main(conn: Any, judger_bytes: bytes, parent_pid: int) -> None:
    """Worker process: load the judger once, then answer ``(call_id, response, label, sample)``."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which kills us
    except (ValueError, OSError):
        pass
    _start_orphan_watch(parent_pid)
    try:
        judger = pickle.loads(judger_bytes)
    except BaseException as exc:  # noqa: BLE001
        conn.send(("init_error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        call_id, response, label, sample = msg
        try:
            reply = (call_id, "ok", _call_judger(judger, response, label, sample))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, the worker lives on
            reply = (call_id, "error", _describe_exception(exc))
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            reason = _clip(f"judger returned an unpicklable result: {type(exc).__name__}: {exc}")
            data = pickle.dumps((call_id, "error", reason), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            conn.send_bytes(data)
        except OSError:
            return


def _start_orphan_watch(parent_pid: int) -> None:
    """Exit when the parent (the run) is gone, even in the middle of a hung judge call."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os._exit(0)
            except PermissionError:
                pass

    threading.Thread(target=watch, name="rlcli-judge-orphan-watch", daemon=True).start()


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is None:
        return "judger worker process died (exit status unknown)"
    if exitcode < 0:
        try:
            sig = signal.Signals(-exitcode).name
        except ValueError:
            sig = f"signal {-exitcode}"
        return f"judger worker process crashed (killed by {sig})"
    return f"judger worker process crashed (exit code {exitcode})"


class _Proc:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, ctx: Any, judger_bytes: bytes):
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_process_main, args=(child_conn, judger_bytes, os.getpid()), name="rlcli-judge", daemon=True
        )
        self.conn = parent_conn
        try:
            self.process.start()
        finally:
            child_conn.close()  # so that the worker's death reads as EOF here
        self.next_id = 0
        self.closed = False
        self.returncode: int | None = None  # kept by reap(): a closed Process no longer tells it

    def alive(self) -> bool:
        return not self.closed and self.process.is_alive()

    def kill(self) -> None:
        """SIGKILL the worker (its pipe stays open: a reader may still be registered on it)."""
        if self.closed:
            return
        try:
            if self.process.is_alive():
                self.process.kill()
        except (OSError, ValueError, AttributeError):
            pass

    def close_pipe(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass

    def reap(self, timeout: float = 0.0) -> bool:
        """Collect the exited process and close its pipe; True once it is gone."""
        if self.closed:
            return True
        try:
            self.process.join(timeout)
            if self.process.exitcode is None:
                return False
            self.returncode = self.process.exitcode
            self.process.close()
        except (ValueError, AssertionError, OSError):
            pass
        self.close_pipe()
        self.closed = True
        return True


async def _readable(conn: Any, timeout: float | None) -> None:
    """Wait until ``conn`` has data (or EOF). Raises ``asyncio.TimeoutError``."""
    if conn.poll():
        return
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    fd = conn.fileno()
    try:
        loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
    except (NotImplementedError, RuntimeError):  # e.g. Windows' proactor loop: poll in a thread
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise asyncio.TimeoutError
            if await asyncio.to_thread(conn.poll, 0.1 if left is None else min(0.1, left)):
                return
    try:
        await asyncio.wait_for(fut, timeout)
    finally:
        loop.remove_reader(fd)


async def _exitcode(proc: _Proc, wait_s: float = 5.0) -> int | None:
    """The worker's exit code, waiting up to ``wait_s`` for it to be known (the forkserver reports
    it a little after the pipe's EOF; only a crash waits here). Another call's ``_boot`` may reap
    the worker meanwhile (``_reap``); the code is then the one it kept."""
    deadline = time.monotonic() + wait_s
    while True:
        code = proc.returncode if proc.closed else proc.process.exitcode
        if code is not None or time.monotonic() > deadline:
            return code
        await asyncio.sleep(0.01)


class _Slots:
    """An event-loop-agnostic pool of ``n`` slots (each may hold a worker process)."""

    def __init__(self, n: int):
        self.free: list[Any] = [None] * n
        self.waiters: collections.deque[asyncio.Future] = collections.deque()

    async def acquire(self) -> Any:
        if self.free and not self.waiters:
            return self.free.pop()
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(fut.result())
            else:
                try:
                    self.waiters.remove(fut)
                except ValueError:
                    pass
            raise

    def release(self, item: Any) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                try:
                    fut.get_loop().call_soon_threadsafe(_hand_over, fut, item, self)
                except RuntimeError:  # that waiter's event loop is closed
                    continue
                return
        self.free.append(item)


def _hand_over(fut: asyncio.Future, item: Any, slots: _Slots) -> None:
    if fut.done():  # cancelled meanwhile: give the slot to the next waiter
        slots.release(item)
    else:
        fut.set_result(item)


class _ProcessExecutor:
    """The part of :class:`~rlcli.judgers.pool.JudgePool` that judges a sample in a worker process."""

    timeout_s: float
    _name: str
    _closed: bool
    _ctx: Any
    _judger_bytes: bytes
    _slots: _Slots | None
    _procs: list[_Proc]
    _init_error: str | None

    async def _run_process(self, sample: Sample) -> _Outcome:
        assert self._slots is not None
        if self._init_error is not None:
            return _Outcome("error", self._init_error)
        proc: _Proc | None = await self._slots.acquire()
        try:
            if proc is None or not proc.alive():
                if proc is not None:
                    self._discard(proc)
                proc = None
                proc = await self._boot()
            call_id = proc.next_id
            proc.next_id += 1
            # Per-token lists stay here: judgers get the text, the label and the sample's metadata.
            light = dataclasses.replace(sample, logprobs=[], token_versions=[], response_mask=[])
            try:
                data = pickle.dumps((call_id, sample.response, sample.label, light), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                return _Outcome("error", _clip(f"could not send the sample to the judger worker: {type(exc).__name__}: {exc}"))
            try:
                proc.conn.send_bytes(data)
            except OSError:
                dead, proc = proc, None
                return await self._crashed(dead)
            try:
                await _readable(proc.conn, self.timeout_s)
            except asyncio.TimeoutError:
                self._discard(proc)
                proc = None
                return _timed_out(self.timeout_s)
            try:
                reply_id, kind, value = proc.conn.recv()
            except (EOFError, OSError):
                dead, proc = proc, None
                return await self._crashed(dead)
            if reply_id != call_id:  # cannot happen with one call per worker; be safe
                self._discard(proc)
                proc = None
                return _Outcome("error", "judger worker answered out of order")
            return _Outcome("ok", value) if kind == "ok" else _Outcome("error", value)
        except BaseException:
            if proc is not None:  # cancelled (pause) or unexpected: the worker's state is unknown
                self._discard(proc)
                proc = None
            raise
        finally:
            self._slots.release(proc)

    async def _crashed(self, proc: _Proc) -> _Outcome:
        code = await _exitcode(proc)
        self._discard(proc)
        if self._closed:
            raise _Abort("judge pool was closed during the call")
        reason = _exit_reason(code)
        log.warning("judger %s: %s; starting a new worker", self._name, reason)
        return _Outcome("error", reason)

    async def _boot(self) -> _Proc:
        if self._closed:
            raise _Abort("judge pool is closed")
        self._reap()
        # Starting a process can take a while (the first one also starts the forkserver), so it
        # happens off the event loop; a process started for a cancelled caller is killed.
        starting = asyncio.get_running_loop().run_in_executor(None, _Proc, self._ctx, self._judger_bytes)
        try:
            proc = await asyncio.shield(starting)
        except asyncio.CancelledError:
            starting.add_done_callback(_kill_started)
            raise
        self._procs.append(proc)
        try:
            await _readable(proc.conn, _BOOT_TIMEOUT_S)
            kind, value = proc.conn.recv()
        except asyncio.TimeoutError:
            self._discard(proc)
            raise _Abort(f"judger worker process did not start within {_BOOT_TIMEOUT_S:g}s") from None
        except (EOFError, ConnectionError, OSError):
            code = await _exitcode(proc)
            self._discard(proc)
            raise _Abort(f"judger worker process failed to start: {_exit_reason(code)}") from None
        except BaseException:
            self._discard(proc)
            raise
        if kind != "ready":
            self._discard(proc)
            self._init_error = _clip(f"judger {self._name!r} could not be loaded in a worker process: {value}")
            raise _Abort(self._init_error)
        proc.ready = True
        return proc

    def _discard(self, proc: _Proc) -> None:
        """Kill a worker we own (no reader registered on its pipe); it is reaped later."""
        proc.kill()
        proc.close_pipe()
        proc.reap(0.0)

    def _reap(self) -> None:
        self._procs = [p for p in self._procs if not p.reap(0.0)]


def _kill_started(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is None:
        proc = fut.result()
        proc.kill()
        proc.close_pipe()
        proc.reap(1.0)

