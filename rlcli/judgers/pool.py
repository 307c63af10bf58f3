"""The judge pool: run a judger on COMPLETED samples without ever crashing the run.

:class:`JudgePool` wraps one judger instance and fills ``sample.reward`` (a dict with a finite
float ``"score"``) or marks the sample ``FAILED`` with a reason in ``sample.error``:

* ``"judger timeout after 30.0s"``: the call ran longer than ``timeout_s``;
* ``"judger raised ValueError: ..."``: the judger raised;
* ``"judger worker process crashed (exit code 1)"`` / ``"... (killed by SIGSEGV)"``;
* ``"judger ran out of its memory limit (memory_limit_mb: 2048) ..."``;
* ``"judger returned ..."``: the result is not a number or a dict with a finite ``"score"``, or
  the score is beyond ``+-1e6`` (logged once per judger as a warning).

Where ``judge()`` runs is the judger config's ``executor``:

``process`` (the default; :mod:`rlcli.judgers.processes`)
    A pool of worker processes, each running one call at a time with its memory capped at
    ``memory_limit_mb``. The judger is pickled once when the pool is built and loaded once per
    worker, never per call. A worker whose call times out is killed and replaced; a worker that
    dies (``os._exit``, a segfault, the OOM killer) or hits its memory limit fails only the
    call it was running. Hung calls time out side by side: once a call has run
    ``min(0.5 s, timeout_s / 10)``, the calls behind it go to other workers, started as needed
    up to ``max_workers``. Workers start on first use; their start-up time is not counted
    against the timeout. They are started with ``forkserver`` (``spawn`` where that is
    missing), never ``fork``; as with any multiprocessing code, the judger class must live in
    an importable module and a script that builds such a pool needs an
    ``if __name__ == "__main__":`` guard.
``thread`` (:mod:`rlcli.judgers.threads`)
    For judgers that cannot be pickled. A pool of daemon threads; the timeout is measured from
    when a worker picks the call up. A thread cannot be killed: a call that runs past
    ``min(0.5 s, timeout_s / 10)`` (or is cancelled) *retires* its thread (it exits when the call
    eventually returns) and a replacement worker is started, so capacity is kept. At most
    ``max_hung_threads`` retired threads are replaced (``hung_threads`` reports how many are
    stuck); beyond that, a call that finds no free thread within ``timeout_s`` times out.
    No memory limit, and a judger that calls ``os._exit`` ends the run. Daemon threads, unlike
    a ``concurrent.futures.ThreadPoolExecutor``'s, never block interpreter exit.
``inline``
    Called directly in the event loop. No timeout, no isolation, no overhead: for trivial rules.

If ``judge()`` returns an awaitable (an ``async def`` judger, e.g. an HTTP reward model), it is
awaited: with the timeout in the event loop for ``inline``, in a private loop in a worker
otherwise.

Timeouts, crashed workers and memory-limit failures are counted (:meth:`JudgePool.pop_stats`)
and logged by judger name: the first of each kind at once, the rest in one line per step.

Pause protocol (XTuner's judger grace): :meth:`JudgePool.cancel_pending` lets running calls
finish for ``grace_s`` seconds, then cancels the rest; their samples become ``ABORTED`` with
``reward None`` and ``finish_reason "abort"``. Counters are read and reset with
:meth:`JudgePool.pop_stats`.

A judge call and its outcome are in :mod:`rlcli.judgers.calls`. :mod:`rlcli.judging` re-exports
this module's public names for code written before the pool lived here.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import logging
import multiprocessing
import os
import pickle
import threading
import time
from typing import Any, Literal

from rlcli.judgers.calls import _Abort, _clip, _describe_exception, _Outcome, _timed_out, normalize_reward
from rlcli.judgers.calls import warn_bad_result
from rlcli.judgers.processes import _preload, _ProcessExecutor
from rlcli.judgers.threads import _ThreadExecutor, _ThreadWorkers
from rlcli.lockstep import track
from rlcli.types import Sample, Status

__all__ = ["Executor", "JudgePool", "JudgerNotPicklable", "default_workers", "normalize_reward"]

log = logging.getLogger(__name__)

Executor = Literal["inline", "thread", "process"]
DEFAULT_MAX_WORKERS = 16
DEFAULT_MEMORY_LIMIT_MB = 2048

# outcome kind -> (counter, how the log names it)
_FAULTS = {"timeout": ("judger/timeouts", "timed out"), "crash": ("judger/crashes", "crashed their worker process"),
           "memory": ("judger/out_of_memory", "went over the memory limit")}


class JudgerNotPicklable(TypeError):
    """The ``process`` executor (the default) met a judger that cannot be pickled."""


def default_workers() -> int:
    """min(4, usable CPU cores)."""
    try:
        cpus = len(os.sched_getaffinity(0))  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


@dataclasses.dataclass
class _Pending:
    sample: Sample
    cancelled_by: Literal["pause", "close"] | None = None


class JudgePool(_ThreadExecutor, _ProcessExecutor):
    """Runs one judger on samples with a timeout, in worker processes, a thread pool or the event loop.

    Args:
        judger: a judger instance (``judge(response, label, sample)``); for ``process`` it must
            be picklable.
        executor / timeout_s / memory_limit_mb: default to the judger config's (``process``, 30 s,
            2048 MB without a config); ``memory_limit_mb`` (0: no limit) applies to ``process``.
        workers: concurrent judge calls; default ``min(4, cpu cores)``.
        max_workers: worker processes in all while calls are stuck (``process``); default 16.
        max_hung_threads: how many stuck threads (``thread`` executor) get a replacement.
        mp_context: multiprocessing start method for ``process`` (default ``forkserver`` where
            available, else ``spawn``; never ``fork``, which is unsafe in a threaded process).
        task: the task's name, for the log.
    """

    def __init__(
        self,
        judger: Any,
        *,
        executor: Executor | None = None,
        timeout_s: float | None = None,
        workers: int | None = None,
        max_workers: int | None = None,
        max_hung_threads: int | None = None,
        memory_limit_mb: int | None = None,
        mp_context: str | None = None,
        task: str | None = None,
    ):
        cfg = getattr(judger, "config", None)
        self.judger = judger
        self.executor: Executor = executor or getattr(cfg, "executor", None) or "process"
        if self.executor not in ("inline", "thread", "process"):
            raise ValueError(f"executor must be 'inline', 'thread' or 'process', got {self.executor!r}")
        self.timeout_s = float(timeout_s if timeout_s is not None else getattr(cfg, "timeout_s", 30.0))
        self.truncated_score: float | None = getattr(cfg, "truncated_score", None)
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        self.workers = workers if workers is not None else default_workers()
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        self.max_workers = max(self.workers, max_workers if max_workers is not None else DEFAULT_MAX_WORKERS)
        self.max_hung_threads = max_hung_threads if max_hung_threads is not None else max(16, 2 * self.workers)
        self.memory_limit_mb: int | None = (memory_limit_mb if memory_limit_mb is not None
                                            else getattr(cfg, "memory_limit_mb", DEFAULT_MEMORY_LIMIT_MB)) or None
        name = getattr(judger, "name", "") or type(judger).__name__
        self._name = f"{name} (task {task})" if task else name
        self._closed = False
        self._stats_lock = threading.Lock()
        self._stats = self._zero_stats()
        self._logged: collections.Counter[str] = collections.Counter()  # faults since the last pop_stats
        self._pending: dict[asyncio.Task, _Pending] = {}
        self._threads: _ThreadWorkers | None = None
        self._procs, self._live, self._queue = [], [], collections.deque()
        self._init_error: str | None = None
        if self.executor == "thread":
            self._threads = _ThreadWorkers(self.workers, self.max_hung_threads)
        elif self.executor == "process":
            self._judger_bytes = self._pickle_judger(name)
            method = mp_context or ("forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn")
            if method == "fork":
                raise ValueError("mp_context 'fork' is not supported (unsafe with threads); use forkserver or spawn")
            self._ctx = multiprocessing.get_context(method)
            _preload(self._ctx, judger)

    def _pickle_judger(self, name: str) -> bytes:
        try:
            return pickle.dumps(self.judger)
        except Exception as exc:
            raise JudgerNotPicklable(
                f"judger {name!r} ({type(self.judger).__module__}.{type(self.judger).__qualname__}) cannot be "
                f"pickled, which executor 'process' (the default) needs to run it in worker processes "
                f"({type(exc).__name__}: {exc}). Make it picklable (create clients, locks and open files on "
                f"first use, or leave them out in __getstate__), or set its `executor: thread` (no memory "
                f"limit; a hung call cannot be killed)"
            ) from exc

    # ---------------------------------------------------------------- public API
    @property
    def hung_threads(self) -> int:
        """Threads still stuck in a call that ran long, timed out or was cancelled (``thread`` executor)."""
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
                result = self.judger.judge(sample.response, sample.label, sample)
                # a plain judge() may still hand back an awaitable (a wrapper around an async judger)
                outcome = await self._await_inline(result) if inspect.isawaitable(result) else _Outcome("ok", result)
            except Exception as exc:
                outcome = _Outcome("error", _describe_exception(exc))
            self._count("judger/time_s", time.perf_counter() - start)
            self._apply(sample, outcome)
            return
        entry = _Pending(sample)
        start = time.perf_counter()
        task = track(asyncio.ensure_future(self._run(sample)))  # runs off the loop: a lockstep engine waits
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
        """Counters since the last call, then reset them; logs one line if calls timed out,
        crashed their worker or hit the memory limit meanwhile.

        ``judger/calls`` (judged samples), ``judger/errors`` (exceptions, bad results, crashes,
        memory), of those ``judger/crashes`` (the worker process died in the call) and
        ``judger/out_of_memory`` (the call hit ``memory_limit_mb``), ``judger/timeouts``,
        ``judger/aborted`` (cancelled by a pause), ``judger/truncated`` (cut off at max_tokens and
        given ``truncated_score`` without a call), ``judger/time_s`` (summed wall time of the
        calls, waiting for a free worker included), and the gauge ``judger/hung_threads`` (not
        reset).
        """
        with self._stats_lock:
            stats, self._stats = self._stats, self._zero_stats()
            logged, self._logged = self._logged, collections.Counter()
        stats["judger/hung_threads"] = self.hung_threads
        if sum(logged.values()) > 1:
            what = ", ".join(f"{n} {_FAULTS[k][1]}" for k, n in logged.items())
            log.warning("judger %s: of %d calls since the last step, %s (timeout_s: %g, memory_limit_mb: %s, "
                        "executor: %s)", self._name, stats["judger/calls"], what, self.timeout_s,
                        self.memory_limit_mb, self.executor)
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
        self._close_processes()

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
        return {"judger/calls": 0, "judger/errors": 0, "judger/timeouts": 0, "judger/crashes": 0,
                "judger/out_of_memory": 0, "judger/aborted": 0, "judger/truncated": 0, "judger/time_s": 0.0}

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
            warn_bad_result(self._name, reason)
        else:
            reason = outcome.value
        self._count("judger/timeouts" if outcome.kind == "timeout" else "judger/errors")
        sample.status, sample.reward, sample.error = Status.FAILED, None, reason
        if outcome.kind not in _FAULTS:
            log.debug("judger %s: sample uid=%s FAILED: %s", self._name, sample.uid, reason)
            return
        counter = _FAULTS[outcome.kind][0]
        with self._stats_lock:
            if counter != "judger/timeouts":
                self._stats[counter] += 1
            first = not self._logged[outcome.kind]
            self._logged[outcome.kind] += 1
        if first:  # the rest of this step's are summed up by pop_stats()
            log.warning("judger %s: sample uid=%s FAILED: %s", self._name, sample.uid, reason)

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

    async def _run_inline(self, sample: Sample) -> _Outcome:
        try:
            result = self.judger.judge(sample.response, sample.label, sample)
        except Exception as exc:
            return _Outcome("error", _describe_exception(exc))
        if not inspect.isawaitable(result):
            return _Outcome("ok", result)
        return await self._await_inline(result)

    async def _await_inline(self, result: Any) -> _Outcome:
        """The outcome of an awaitable an inline ``judge`` returned, within ``timeout_s``."""
        task = track(asyncio.ensure_future(result))  # its I/O is not a ready callback: a lockstep engine waits
        try:
            await asyncio.wait([task], timeout=self.timeout_s)
        finally:
            if not task.done():  # timed out, or we are cancelled
                task.cancel()
                await asyncio.wait([task])
        if task.cancelled():
            return _timed_out(self.timeout_s)
        exc = task.exception()
        return _Outcome("error", _describe_exception(exc)) if exc is not None else _Outcome("ok", task.result())
