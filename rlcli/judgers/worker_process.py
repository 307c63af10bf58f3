"""One judge worker process of the ``process`` executor, and the parent's handle on it.

The worker (:func:`_process_main`, the process target) caps its own memory, loads the pickled
judger once, then answers the calls it is sent, one at a time and in the order they came:

* parent → worker: ``("calls", [(call_id, response, label, sample), ...])``, ``("skip", [call_id,
  ...])`` (calls handed to another worker: answer ``"skipped"`` instead of running them) or
  ``None`` (exit);
* worker → parent: ``("ready", pid)`` or ``("init_error", reason)`` once, then one
  ``(call_id, kind, value)`` per call, ``kind`` being ``"ok"`` (the judger's result),
  ``"error"`` (its exception, described), ``"memory"`` (it hit the memory limit) or
  ``"skipped"``.

Because a worker answers in order, the parent knows which call is running: the first one not
yet answered. A ``MemoryError`` outside a judge call ends the worker with exit code
``_OOM_EXIT_CODE``. A worker exits by itself when the run's process is gone.
"""

from __future__ import annotations

import asyncio
import collections
import os
import pickle
import signal
import threading
import time
from typing import Any

from rlcli.judgers.calls import _call_judger, _clip, _describe_exception

_BOOT_TIMEOUT_S = 120.0  # a worker process must be ready within this (not counted in timeout_s)
_OOM_EXIT_CODE = 86  # the worker ran out of memory outside a judge call


def _process_main(conn: Any, judger_bytes: bytes, parent_pid: int, memory_limit_mb: int | None = None) -> None:
    """Worker process: cap memory, load the judger once, then answer calls (module docstring)."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which kills us
    except (ValueError, OSError):
        pass
    _start_orphan_watch(parent_pid)  # before the limit: the thread's stack counts against it
    _limit_memory(memory_limit_mb)
    try:
        judger = pickle.loads(judger_bytes)
    except BaseException as exc:  # noqa: BLE001
        conn.send(("init_error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", os.getpid()))
    try:
        _serve(conn, judger)
    except MemoryError:
        os._exit(_OOM_EXIT_CODE)


def _serve(conn: Any, judger: Any) -> None:
    pending: collections.deque[tuple] = collections.deque()
    skipped: set[int] = set()

    def take(msg: Any) -> bool:
        if msg is None:
            return False
        kind, items = msg
        (pending.extend if kind == "calls" else skipped.update)(items)
        return True

    while True:
        try:
            if not pending and not take(conn.recv()):
                return
            while conn.poll():  # skips (and more calls) that came while the last call ran
                if not take(conn.recv()):
                    return
        except (EOFError, OSError):
            return
        call_id, response, label, sample = pending.popleft()
        if call_id in skipped:
            skipped.discard(call_id)
            reply: tuple = (call_id, "skipped", None)
        else:
            reply = _answer(judger, call_id, response, label, sample)
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except MemoryError:
            raise
        except Exception as exc:
            reason = _clip(f"judger returned an unpicklable result: {type(exc).__name__}: {exc}")
            data = pickle.dumps((call_id, "error", reason), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            conn.send_bytes(data)
        except OSError:
            return


def _answer(judger: Any, call_id: int, response: str, label: Any, sample: Any) -> tuple:
    try:
        return (call_id, "ok", _call_judger(judger, response, label, sample))
    except MemoryError as exc:
        return (call_id, "memory", _describe_exception(exc))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, the worker lives on
        return (call_id, "error", _describe_exception(exc))


def _limit_memory(limit_mb: int | None) -> None:
    """Cap this process's data memory (heap and private mappings, ``RLIMIT_DATA``: Linux 4.7+) at
    what it holds now plus ``limit_mb``: a worker forked from a forkserver that had imported a
    large library (torch, for a judger module that imports it) starts with that library's mappings,
    which are not the judger's to pay for; the judger gets ``limit_mb`` on top of them."""
    if not limit_mb:
        return
    try:
        import resource

        limit = _data_bytes() + (int(limit_mb) << 20)
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    except (ImportError, ValueError, OSError):  # no such limit on this platform: run without it
        pass


def _data_bytes() -> int:
    """This process's data memory as ``RLIMIT_DATA`` counts it (``VmData``); 0 where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) << 10  # kB
    except (OSError, ValueError, IndexError):
        pass
    return 0


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

    def __init__(self, ctx: Any, judger_bytes: bytes, memory_limit_mb: int | None = None):
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_process_main, args=(child_conn, judger_bytes, os.getpid(), memory_limit_mb),
            name="rlcli-judge", daemon=True,
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
    it a little after the pipe's EOF; only a crash waits here). Another call's start-up may reap
    the worker meanwhile; the code is then the one it kept."""
    deadline = time.monotonic() + wait_s
    while True:
        code = proc.returncode if proc.closed else proc.process.exitcode
        if code is not None or time.monotonic() > deadline:
            return code
        await asyncio.sleep(0.01)
