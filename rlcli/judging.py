"""The judge executor: run a judger on COMPLETED samples without ever crashing the run.

:class:`JudgePool` wraps one judger instance and fills ``sample.reward`` (a dict with a finite
float ``"score"``) or marks the sample ``FAILED`` with a reason in ``sample.error``:

* ``"judger timeout after 30.0s"``: the call ran longer than ``timeout_s``;
* ``"judger raised ValueError: ..."``: the judger raised;
* ``"judger worker process crashed (exit code 1)"`` / ``"... (killed by SIGSEGV)"``;
* ``"judger returned ..."``: the result is not a number or a dict with a finite ``"score"``.

Where ``judge()`` runs is the judger config's ``executor``:

``inline``
    Called directly in the event loop. No timeout, no isolation, no overhead: for trivial rules.
``thread``
    A pool of daemon threads; the timeout is measured from when a worker picks the call up.
    A thread cannot be killed, so a call that times out (or is cancelled) leaves its thread
    running: that thread is *retired* (it exits when the call eventually returns) and a
    replacement worker is started, so capacity is kept. At most ``max_hung_threads`` retired
    threads are replaced; beyond that the pool runs with fewer workers until they return
    (``hung_threads`` reports how many are stuck). Daemon threads, unlike a
    ``concurrent.futures.ThreadPoolExecutor``'s, never block interpreter exit.
``process``
    A pool of worker processes, each running one call at a time. The judger is pickled once
    when the pool is built and loaded once per worker, never per call. A worker that times out
    is killed and replaced; a worker that dies (``os._exit``, a segfault, the OOM killer) fails
    only the sample it was judging. Workers start on first use; their start-up time is not
    counted against the timeout. They are started with ``forkserver`` (``spawn`` where that is
    missing), never ``fork``; as with any multiprocessing code, the judger class must live in an
    importable module and a script that builds such a pool needs an
    ``if __name__ == "__main__":`` guard.

If ``judge()`` returns an awaitable (an ``async def`` judger, e.g. an HTTP reward model), it is
awaited: with the timeout in the event loop for ``inline``, in a private loop in a worker
otherwise.

Pause protocol (XTuner's judger grace): :meth:`JudgePool.cancel_pending` lets running calls
finish for ``grace_s`` seconds, then cancels the rest; their samples become ``ABORTED`` with
``reward None`` and ``finish_reason "abort"``. Counters are read and reset with
:meth:`JudgePool.pop_stats`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import logging
import math
import multiprocessing
import numbers
import os
import pickle
import queue
import signal
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Literal

from rlcli.types import Sample, Status

__all__ = ["JudgePool", "default_workers", "normalize_reward"]

log = logging.getLogger(__name__)

Executor = Literal["inline", "thread", "process"]

_MAX_ERROR_CHARS = 2000
_BOOT_TIMEOUT_S = 120.0  # a worker process must be ready within this (not counted in timeout_s)


def default_workers() -> int:
    """min(4, usable CPU cores)."""
    try:
        cpus = len(os.sched_getaffinity(0))  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


def _describe_exception(exc: BaseException) -> str:
    return _clip(f"judger raised {type(exc).__name__}: {exc}")


def _call_judger(judger: Any, response: str, label: Any, sample: Sample) -> Any:
    """Call ``judger.judge`` in a worker thread or process, running an async judger to completion."""
    result = judger.judge(response, label, sample)
    if inspect.isawaitable(result):
        async def _await() -> Any:
            return await result

        result = asyncio.run(_await())
    return result


def normalize_reward(result: Any) -> tuple[dict[str, Any] | None, str | None]:
    """Turn a judger result into ``(reward, None)`` or ``(None, reason)``.

    A real number becomes ``{"score": float(x)}``; a dict must hold a real, finite ``"score"``
    (it is converted to ``float``, other keys are kept); anything else is rejected.
    """
    if isinstance(result, numbers.Real):
        score, reward = result, {}
    elif isinstance(result, dict):
        if "score" not in result:
            return None, _clip(f"judger returned a dict without 'score' (keys: {sorted(map(str, result))})")
        score, reward = result["score"], dict(result)
        if not isinstance(score, numbers.Real):
            return None, _clip(f"judger returned a non-numeric score {score!r} ({type(score).__name__})")
    else:
        return None, _clip(f"judger returned {type(result).__name__} {result!r}; expected a number or a dict with 'score'")
    score = float(score)
    if not math.isfinite(score):
        return None, f"judger returned a non-finite score {score}"
    reward["score"] = score
    return reward, None


@dataclasses.dataclass
class _Outcome:
    """What one judge call produced; applied to the sample by :meth:`JudgePool.judge`."""

    kind: Literal["ok", "timeout", "error"]
    value: Any = None  # the raw result for "ok", the reason for "error"


class _Abort(Exception):
    """Internal: the call could not run (pool closed, worker failed to boot)."""


# ============================================================================ thread workers
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


# =========================================================================== process workers
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


# ================================================================================ the pool
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


@dataclasses.dataclass
class _Pending:
    sample: Sample
    cancelled_by: Literal["pause", "close"] | None = None


class JudgePool:
    """Runs one judger on samples with a timeout, in the event loop, a thread pool or a process pool.

    Args:
        judger: a judger instance (``judge(response, label, sample)``); for ``process`` it must
            be picklable.
        executor / timeout_s: default to the judger config's ``executor`` and ``timeout_s``.
        workers: concurrent judge calls; default ``min(4, cpu cores)``.
        max_hung_threads: how many stuck threads (``thread`` executor) get a replacement.
        mp_context: multiprocessing start method for ``process`` (default ``forkserver`` where
            available, else ``spawn``; never ``fork``, which is unsafe in a threaded process).
    """

    def __init__(
        self,
        judger: Any,
        *,
        executor: Executor | None = None,
        timeout_s: float | None = None,
        workers: int | None = None,
        max_hung_threads: int | None = None,
        mp_context: str | None = None,
    ):
        cfg = getattr(judger, "config", None)
        self.judger = judger
        self.executor: Executor = executor or getattr(cfg, "executor", None) or "thread"
        if self.executor not in ("inline", "thread", "process"):
            raise ValueError(f"executor must be 'inline', 'thread' or 'process', got {self.executor!r}")
        self.timeout_s = float(timeout_s if timeout_s is not None else getattr(cfg, "timeout_s", 30.0))
        self.truncated_score: float | None = getattr(cfg, "truncated_score", None)
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        self.workers = workers if workers is not None else default_workers()
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        self.max_hung_threads = max_hung_threads if max_hung_threads is not None else max(4, 2 * self.workers)
        self._name = getattr(judger, "name", "") or type(judger).__name__
        self._closed = False
        self._stats_lock = threading.Lock()
        self._stats = self._zero_stats()
        self._pending: dict[asyncio.Task, _Pending] = {}
        self._threads: _ThreadWorkers | None = None
        self._slots: _Slots | None = None
        self._procs: list[_Proc] = []
        self._init_error: str | None = None
        if self.executor == "thread":
            self._threads = _ThreadWorkers(self.workers, self.max_hung_threads)
        elif self.executor == "process":
            try:
                self._judger_bytes = pickle.dumps(judger)
            except Exception as exc:
                raise TypeError(
                    f"judger {self._name!r} cannot be pickled for executor 'process' "
                    f"({type(exc).__name__}: {exc}); make it picklable or use executor 'thread'"
                ) from exc
            method = mp_context or ("forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn")
            if method == "fork":
                raise ValueError("mp_context 'fork' is not supported (unsafe with threads); use forkserver or spawn")
            self._ctx = multiprocessing.get_context(method)
            self._slots = _Slots(self.workers)

    # ---------------------------------------------------------------- public API
    @property
    def hung_threads(self) -> int:
        """Threads still stuck in a call that timed out or was cancelled (``thread`` executor)."""
        if self._threads is None:
            return 0
        with self._threads.lock:
            return len(self._threads.hung)

    @property
    def pending(self) -> int:
        """Judge calls in progress."""
        return len(self._pending)

    async def judge(self, sample: Sample) -> None:
        """Judge one sample in place: COMPLETED → reward set, or FAILED with ``error``; others untouched."""
        if sample.status != Status.COMPLETED:
            return
        if self._closed:
            raise RuntimeError("JudgePool is closed")
        if self.truncated_score is not None and sample.finish_reason == "length":
            self._count("judger/truncated")  # scored without a judge call: it never ended with EOS
            sample.reward, sample.error = {"score": float(self.truncated_score), "truncated": True}, None
            return
        if self.executor == "inline" and not inspect.iscoroutinefunction(self.judger.judge):
            start = time.perf_counter()  # fast path: no task, no await (cheap rule-based judgers)
            try:
                outcome = _Outcome("ok", self.judger.judge(sample.response, sample.label, sample))
            except Exception as exc:
                outcome = _Outcome("error", _describe_exception(exc))
            self._count("judger/time_s", time.perf_counter() - start)
            self._apply(sample, outcome)
            return
        entry = _Pending(sample)
        start = time.perf_counter()
        task = asyncio.ensure_future(self._run(sample))
        self._pending[task] = entry
        try:
            outcome = await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            outer_cancelled = bool(current is not None and getattr(current, "cancelling", lambda: 0)())
            if entry.cancelled_by is None or outer_cancelled:
                raise
            if entry.cancelled_by == "close":
                self._count("judger/calls")
                self._count("judger/errors")
                sample.status, sample.reward, sample.error = Status.FAILED, None, "judge pool was closed during the call"
            return  # "pause": cancel_pending() already marked the sample ABORTED
        finally:
            self._pending.pop(task, None)
            self._count("judger/time_s", time.perf_counter() - start)
        self._apply(sample, outcome)

    async def judge_group(self, samples: list[Sample], *, only_if_all_completed: bool = False) -> list[Sample]:
        """Judge the COMPLETED members of a group concurrently; returns ``samples`` (order kept).

        With ``only_if_all_completed`` nothing is judged unless every member is COMPLETED (a
        group that will be re-rolled anyway costs no judge time).
        """
        if only_if_all_completed and any(s.status != Status.COMPLETED for s in samples):
            return samples
        await asyncio.gather(*(self.judge(s) for s in samples))
        return samples

    async def cancel_pending(self, grace_s: float = 10.0) -> int:
        """Let in-flight judge calls run ``grace_s`` more seconds, then cancel the rest.

        Samples whose call is cancelled become ABORTED with ``reward None`` and
        ``finish_reason "abort"``. Returns how many were aborted.
        """
        deadline = time.monotonic() + max(0.0, grace_s)
        while self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await asyncio.wait(list(self._pending), timeout=left)
        victims = []
        for task, entry in list(self._pending.items()):
            if entry.cancelled_by is not None or task.done() or not task.cancel():
                continue
            entry.cancelled_by = "pause"
            s = entry.sample
            s.status, s.reward, s.finish_reason = Status.ABORTED, None, "abort"
            s.error = f"judge call cancelled after the {grace_s:g}s pause grace period"
            victims.append(task)
        if victims:
            self._count("judger/aborted", len(victims))
            await asyncio.wait(victims)  # let them release their workers
        return len(victims)

    def pop_stats(self) -> dict[str, float]:
        """Counters since the last call, then reset them.

        ``judger/calls`` (judged samples), ``judger/errors`` (exceptions, bad results, crashes),
        ``judger/timeouts``, ``judger/aborted`` (cancelled by a pause), ``judger/truncated`` (cut off
        at max_tokens and given ``truncated_score`` without a call), ``judger/time_s`` (summed
        wall time of the calls, waiting for a free worker included), and the gauge
        ``judger/hung_threads`` (not reset).
        """
        with self._stats_lock:
            stats, self._stats = self._stats, self._zero_stats()
        stats["judger/hung_threads"] = self.hung_threads
        return stats

    def close(self) -> None:
        """Stop every worker, killing processes (hung ones too). Idempotent.

        Calls still in flight are cancelled; their samples become FAILED ("judge pool was
        closed during the call").
        """
        if self._closed:
            return
        self._closed = True
        for task, entry in list(self._pending.items()):
            if entry.cancelled_by is None and not task.done():
                entry.cancelled_by = "close"
                try:
                    task.get_loop().call_soon_threadsafe(task.cancel)
                except RuntimeError:  # its loop is closed
                    pass
        if self._threads is not None:
            self._threads.close()
        idle = {id(p) for p in (self._slots.free if self._slots is not None else []) if p is not None}
        for p in self._procs:
            p.kill()
            if id(p) in idle:
                p.close_pipe()  # busy workers' pipes are closed by their (cancelled) callers
        deadline = time.monotonic() + 2.0
        self._procs = [p for p in self._procs if not p.reap(max(0.0, deadline - time.monotonic()))]

    async def aclose(self) -> None:
        self.close()

    def __enter__(self) -> "JudgePool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> "JudgePool":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"JudgePool({self._name!r}, executor={self.executor!r}, workers={self.workers}, "
                f"timeout_s={self.timeout_s}, pending={self.pending}, closed={self._closed})")

    # ---------------------------------------------------------------- internals
    @staticmethod
    def _zero_stats() -> dict[str, float]:
        return {"judger/calls": 0, "judger/errors": 0, "judger/timeouts": 0, "judger/aborted": 0,
                "judger/truncated": 0, "judger/time_s": 0.0}

    def _count(self, key: str, n: float = 1) -> None:
        with self._stats_lock:
            self._stats[key] += n

    def _apply(self, sample: Sample, outcome: _Outcome) -> None:
        self._count("judger/calls")
        if outcome.kind == "ok":
            reward, reason = normalize_reward(outcome.value)
            if reward is not None:
                sample.reward, sample.error = reward, None
                return
        else:
            reason = outcome.value
        self._count("judger/timeouts" if outcome.kind == "timeout" else "judger/errors")
        sample.status, sample.reward, sample.error = Status.FAILED, None, reason
        log.debug("judger %s: sample uid=%s FAILED: %s", self._name, sample.uid, reason)

    async def _run(self, sample: Sample) -> _Outcome:
        try:
            if self.executor == "inline":
                return await self._run_inline(sample)
            if self.executor == "thread":
                return await self._run_thread(sample)
            return await self._run_process(sample)
        except _Abort as exc:
            return _Outcome("error", str(exc))
        except Exception as exc:  # a bug in the executor must not crash the run either
            log.exception("judger %s: executor error", self._name)
            return _Outcome("error", _clip(f"judge executor error: {type(exc).__name__}: {exc}"))

    def _timeout_outcome(self) -> _Outcome:
        return _Outcome("timeout", f"judger timeout after {self.timeout_s}s")

    async def _run_inline(self, sample: Sample) -> _Outcome:
        try:
            result = self.judger.judge(sample.response, sample.label, sample)
        except Exception as exc:
            return _Outcome("error", _describe_exception(exc))
        if not inspect.isawaitable(result):
            return _Outcome("ok", result)
        task = asyncio.ensure_future(result)
        try:
            await asyncio.wait([task], timeout=self.timeout_s)
        finally:
            if not task.done():  # timed out, or we are cancelled
                task.cancel()
                await asyncio.wait([task])
        if task.cancelled():
            return self._timeout_outcome()
        exc = task.exception()
        return _Outcome("error", _describe_exception(exc)) if exc is not None else _Outcome("ok", task.result())

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
            # Wait for a worker to pick the call up (not timed), then for the call itself (timed).
            await asyncio.wait([started, done], return_when=asyncio.FIRST_COMPLETED)
            if not done.done():
                await asyncio.wait([done], timeout=self.timeout_s)
            if not done.done():
                self._threads.abandon(job)
                return self._timeout_outcome()
        except asyncio.CancelledError:
            self._threads.abandon(job)
            raise
        finally:
            if not started.done():
                started.cancel()
        exc = done.exception()
        return _Outcome("error", _describe_exception(exc)) if exc is not None else _Outcome("ok", done.result())

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
                return self._timeout_outcome()
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


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()

