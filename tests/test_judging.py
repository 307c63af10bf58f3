"""The judge executor: rewards, failures, timeouts, crashes, hung threads, pause grace, counters."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rlcli.judgers.base import Judger, JudgerConfig
from rlcli.judgers.composed import ComposedJudger
from rlcli.judging import JudgePool, default_workers, normalize_reward
from rlcli.types import Sample, Status

REPO = Path(__file__).resolve().parents[1]


class ScriptedJudger(Judger):
    """Test judger whose behaviour is chosen by the response text (picklable, for process pools)."""

    name = "scripted"

    def __init__(self, config: JudgerConfig | None = None):
        super().__init__(config)
        self.calls = 0

    def judge(self, response, label, sample):
        self.calls += 1
        cmd, _, arg = response.partition(":")
        if cmd == "score":
            return float(arg)
        if cmd == "dict":
            return {"score": float(arg), "acc": True}
        if cmd == "raise":
            raise ValueError(arg or "boom")
        if cmd == "sleep":
            time.sleep(float(arg))
            return 1.0
        if cmd == "exit":
            os._exit(int(arg or 1))
        if cmd == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if cmd == "pid":
            return {"score": 1.0, "pid": os.getpid(), "calls": self.calls}
        if cmd == "nan":
            return float("nan")
        if cmd == "noscore":
            return {"acc": True}
        if cmd == "text":
            return "1.0"
        if cmd == "bool":
            return True
        if cmd == "lambda":
            return {"score": 1.0, "fn": lambda: 0}  # cannot travel back from a worker process
        if cmd == "labelsize":
            return {"score": 1.0, "logprobs": len(sample.logprobs), "label": label}
        raise AssertionError(f"unknown command {response!r}")


class CountPickles(ScriptedJudger):
    """Counts how often it is pickled (in the parent process)."""

    pickled = 0

    def __getstate__(self):
        type(self).pickled += 1
        return dict(self.__dict__)


class BrokenInWorker(ScriptedJudger):
    """Pickles fine in the parent, fails to load in a worker."""

    def __setstate__(self, state):
        raise RuntimeError("cannot load here")


class BlockingJudger(Judger):
    """Blocks on an event (thread executor tests: a 'hung' call that we can release later)."""

    name = "blocking"

    def __init__(self, config: JudgerConfig | None = None):
        super().__init__(config)
        self.release = threading.Event()
        self.started = threading.Semaphore(0)

    def judge(self, response, label, sample):
        if response == "block":
            self.started.release()
            self.release.wait(30)
        elif response.startswith("sleep:"):
            time.sleep(float(response[6:]))
        return 1.0


class AsyncJudger(Judger):
    """An async judger (e.g. an HTTP reward model)."""

    name = "async"

    async def judge(self, response, label, sample):
        if response.startswith("sleep:"):
            await asyncio.sleep(float(response[6:]))
        if response == "raise":
            raise KeyError("missing")
        return {"score": 0.5}


def mk(response: str, uid: int = 0, status: Status = Status.COMPLETED, **kw) -> Sample:
    return Sample(uid=uid, group_id=0, task_name="t", prompt_ids=[1, 2], response=response, label="x",
                  status=status, **kw)


def run(coro):
    return asyncio.run(coro)


def pool_for(judger, executor, **kw) -> JudgePool:
    return JudgePool(judger, executor=executor, **kw)


@pytest.fixture
def blocking():
    j = BlockingJudger(JudgerConfig(timeout_s=0.3, executor="thread"))
    yield j
    j.release.set()


# ------------------------------------------------------------------------------ results
def test_normalize_reward():
    assert normalize_reward(1) == ({"score": 1.0}, None)
    assert normalize_reward(True) == ({"score": 1.0}, None)
    assert normalize_reward({"score": 1, "acc": True}) == ({"score": 1.0, "acc": True}, None)
    assert isinstance(normalize_reward({"score": 1})[0]["score"], float)
    for bad, msg in [({"acc": 1}, "without 'score'"), (float("inf"), "non-finite"), ({"score": float("nan")}, "non-finite"),
                     ("1.0", "expected a number or a dict"), (None, "expected a number"), ({"score": "1"}, "non-numeric")]:
        reward, reason = normalize_reward(bad)
        assert reward is None and msg in reason, (bad, reason)


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
def test_results_errors_and_recovery(executor):
    pool = pool_for(ScriptedJudger(), executor, workers=2, timeout_s=10)
    try:
        samples = [mk("score:0.5", 0), mk("dict:1", 1), mk("raise:bad label", 2), mk("nan", 3), mk("noscore", 4),
                   mk("text", 5), mk("bool", 6)]
        run(pool.judge_group(samples))
        assert samples[0].reward == {"score": 0.5} and samples[0].status == Status.COMPLETED
        assert samples[1].reward == {"score": 1.0, "acc": True}
        assert samples[2].status == Status.FAILED and samples[2].reward is None
        assert samples[2].error == "judger raised ValueError: bad label"
        assert samples[3].status == Status.FAILED and "non-finite" in samples[3].error
        assert samples[4].status == Status.FAILED and "without 'score'" in samples[4].error
        assert samples[5].status == Status.FAILED and "str '1.0'" in samples[5].error
        assert samples[6].reward == {"score": 1.0}
        stats = pool.pop_stats()
        assert stats["judger/calls"] == 7 and stats["judger/errors"] == 4 and stats["judger/timeouts"] == 0
        assert stats["judger/time_s"] >= 0
        # counters reset on read; the pool keeps working after failures
        assert pool.pop_stats()["judger/calls"] == 0
        again = mk("score:1")
        run(pool.judge(again))
        assert again.reward == {"score": 1.0}
        assert pool.pop_stats()["judger/calls"] == 1
    finally:
        pool.close()


@pytest.mark.parametrize("status", [Status.INIT, Status.ABORTED, Status.FAILED, Status.EXPIRED, Status.FILTERED])
def test_only_completed_samples_are_judged(status):
    judger = ScriptedJudger()
    pool = pool_for(judger, "thread")
    s = mk("score:1", status=status, error="earlier")
    run(pool.judge(s))
    assert s.status == status and s.reward is None and s.error == "earlier"
    assert judger.calls == 0 and pool.pop_stats()["judger/calls"] == 0
    pool.close()


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_truncated_score_scores_responses_without_eos_without_a_call(executor):
    judger = ScriptedJudger(JudgerConfig(truncated_score=-0.5))
    pool = pool_for(judger, executor)
    cut, ended = mk("score:1", 0, finish_reason="length"), mk("score:1", 1, finish_reason="stop")
    run(pool.judge_group([cut, ended]))
    assert cut.status == Status.COMPLETED and cut.reward == {"score": -0.5, "truncated": True}
    assert ended.reward == {"score": 1.0} and judger.calls == 1
    stats = pool.pop_stats()
    assert stats["judger/truncated"] == 1 and stats["judger/calls"] == 1
    pool.close()
    unset = pool_for(ScriptedJudger(), executor)  # null (the default): judged like any other response
    cut = mk("score:1", 0, finish_reason="length")
    run(unset.judge(cut))
    assert cut.reward == {"score": 1.0} and unset.pop_stats()["judger/truncated"] == 0
    unset.close()


def test_judge_group_keeps_order_and_can_require_all_completed():
    pool = pool_for(ScriptedJudger(), "thread", workers=2)
    group = [mk(f"score:{i}", i) for i in range(4)]
    assert run(pool.judge_group(group)) is group
    assert [s.score for s in group] == [0.0, 1.0, 2.0, 3.0]
    mixed = [mk("score:1", 0), mk("score:1", 1, status=Status.ABORTED)]
    run(pool.judge_group(mixed, only_if_all_completed=True))
    assert [s.reward for s in mixed] == [None, None]
    run(pool.judge_group(mixed))
    assert [s.reward for s in mixed] == [{"score": 1.0}, None]
    pool.close()


def test_composed_unknown_source_fails_the_sample_not_the_run():
    from rlcli.judgers.exact_match import ExactMatchJudger

    class Reg:  # the minimal registry surface the composed judger uses
        def get(self, kind, name):
            assert (kind, name) == ("judger", "exact_match")
            return ExactMatchJudger

    judger = ComposedJudger(ComposedJudger.Config(branches={"toy": {"name": "exact_match"}}), registry=Reg())
    pool = pool_for(judger, "thread")
    good, bad = mk("x", 0, data_source="toy"), mk("x", 1, data_source="elsewhere")
    run(pool.judge_group([good, bad]))
    assert good.reward["score"] == 1.0
    assert bad.status == Status.FAILED
    assert "judger raised ValueError" in bad.error and "'elsewhere'" in bad.error and "toy" in bad.error
    pool.close()


# ------------------------------------------------------------------------------ threads
def test_thread_timeout_replaces_the_hung_worker(blocking):
    pool = pool_for(blocking, "thread", workers=1, timeout_s=0.3, max_hung_threads=2)
    try:
        hung = mk("block")
        t0 = time.monotonic()
        run(pool.judge(hung))
        assert 0.25 < time.monotonic() - t0 < 3
        assert hung.status == Status.FAILED and hung.error == "judger timeout after 0.3s" and hung.reward is None
        assert pool.hung_threads == 1
        # the only worker is stuck, yet the pool still has full capacity
        ok = [mk("fast", i) for i in range(3)]
        run(pool.judge_group(ok))
        assert all(s.reward == {"score": 1.0} for s in ok)
        stats = pool.pop_stats()
        assert stats["judger/timeouts"] == 1 and stats["judger/calls"] == 4 and stats["judger/hung_threads"] == 1
        blocking.release.set()
        deadline = time.monotonic() + 5
        while pool.hung_threads and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.hung_threads == 0
    finally:
        pool.close()


def test_thread_hung_bound_limits_replacements(blocking):
    pool = pool_for(blocking, "thread", workers=1, timeout_s=0.3, max_hung_threads=1)

    async def scenario():
        a, b = mk("block", 0), mk("block", 1)
        await pool.judge(a)  # hung #1: replaced
        await pool.judge(b)  # hung #2: over the bound, no replacement
        assert (a.status, b.status) == (Status.FAILED, Status.FAILED)
        assert pool.hung_threads == 2
        assert len(pool._threads.active) == 0  # capacity is lost until a stuck thread returns
        late = mk("fast", 2)
        t0 = time.monotonic()
        await pool.judge(late)  # no worker can take it: it times out instead of waiting for them forever
        assert 0.25 < time.monotonic() - t0 < 3
        assert late.status == Status.FAILED
        assert late.error.startswith("judger timeout: no judge thread became free within 0.3s (2 threads are stuck")
        blocking.release.set()  # stuck threads return; capacity comes back
        for _ in range(500):
            if pool.hung_threads == 0:
                break
            await asyncio.sleep(0.01)
        assert pool.hung_threads == 0
        assert len(pool._threads.active) == 1
        again = mk("fast", 3)
        await pool.judge(again)
        assert again.reward == {"score": 1.0}

    try:
        run(scenario())
    finally:
        pool.close()


def test_thread_timeout_excludes_queue_time():
    pool = pool_for(BlockingJudger(), "thread", workers=1, timeout_s=0.5)
    samples = [mk("sleep:0.2", i) for i in range(4)]  # 0.8 s in all on one worker, each under 0.5 s
    run(pool.judge_group(samples))
    assert all(s.reward == {"score": 1.0} for s in samples), [s.error for s in samples]
    pool.close()


def test_thread_executor_does_not_block_the_event_loop():
    pool = pool_for(BlockingJudger(), "thread", workers=1, timeout_s=5)

    async def scenario():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.ensure_future(ticker())
        await pool.judge(mk("sleep:0.3"))
        t.cancel()
        return ticks

    assert run(scenario()) >= 10
    pool.close()


def test_hung_thread_does_not_block_interpreter_exit(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio, sys, threading, time
        sys.path.insert(0, {str(REPO)!r})
        from rlcli.judgers.base import Judger
        from rlcli.judging import JudgePool
        from rlcli.types import Sample, Status

        class Forever(Judger):
            name = "forever"
            def judge(self, response, label, sample):
                threading.Event().wait()

        pool = JudgePool(Forever(), executor="thread", timeout_s=0.2, workers=1)
        s = Sample(uid=0, group_id=0, task_name="t", prompt_ids=[1], response="r", status=Status.COMPLETED)
        asyncio.run(pool.judge(s))
        print(s.error, pool.hung_threads)
    """))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "judger timeout after 0.2s 1"
    assert time.monotonic() - t0 < 10


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); look at its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


# ------------------------------------------------------------------------------ async
def test_async_judger_inline_and_thread():
    for executor in ("inline", "thread"):
        pool = pool_for(AsyncJudger(), executor, timeout_s=0.3)
        ok, slow, bad = mk("fast", 0), mk("sleep:5", 1), mk("raise", 2)
        run(pool.judge_group([ok, slow, bad]))
        assert ok.reward == {"score": 0.5}, executor
        assert slow.error == "judger timeout after 0.3s", executor
        assert bad.error == "judger raised KeyError: 'missing'", executor
        pool.close()


# ----------------------------------------------------------------------- pause protocol
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_pause_grace_then_abort(executor):
    """XTuner behaviour 53: a pause during a slow judge aborts the group after the grace period."""
    pool = pool_for(ScriptedJudger(), executor, workers=3, timeout_s=30)

    async def scenario():
        group = [mk("sleep:20", 0), mk("sleep:20", 1)]
        quick = mk("sleep:0.05", 2)
        if executor == "process":  # boot the workers first so the grace period is about judging
            await pool.judge_group([mk("score:1", i) for i in range(3)])
        judging = asyncio.ensure_future(pool.judge_group(group))
        quick_task = asyncio.ensure_future(pool.judge(quick))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        aborted = await pool.cancel_pending(grace_s=0.3)
        elapsed = time.monotonic() - t0
        await asyncio.wait_for(judging, 5)  # the callers return normally, no CancelledError
        await quick_task
        return group, quick, aborted, elapsed

    try:
        group, quick, aborted, elapsed = run(scenario())
        assert aborted == 2 and 0.25 < elapsed < 5
        for s in group:
            assert s.status == Status.ABORTED and s.reward is None and s.finish_reason == "abort"
        assert quick.status == Status.COMPLETED and quick.reward == {"score": 1.0}  # finished within grace
        assert pool.pop_stats()["judger/aborted"] == 2
        assert pool.pending == 0
        after = mk("score:1")
        run(pool.judge(after))
        assert after.reward == {"score": 1.0}
    finally:
        pool.close()


def test_cancel_pending_with_nothing_pending_returns_at_once():
    pool = pool_for(ScriptedJudger(), "thread")
    t0 = time.monotonic()
    assert run(pool.cancel_pending(grace_s=5)) == 0
    assert time.monotonic() - t0 < 1
    pool.close()


def test_cancelling_the_caller_propagates(blocking):
    pool = pool_for(blocking, "thread", workers=1, timeout_s=10)

    async def scenario():
        s = mk("block")
        task = asyncio.ensure_future(pool.judge(s))
        await asyncio.to_thread(blocking.started.acquire, True, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return s

    s = run(scenario())
    assert s.status == Status.COMPLETED and s.reward is None  # untouched: the caller decides
    assert pool.hung_threads == 1  # its thread is abandoned and replaced
    pool.close()


# ------------------------------------------------------------------------------ config
def test_defaults_come_from_the_judger_config():
    pool = JudgePool(ScriptedJudger(JudgerConfig(timeout_s=7, executor="inline")))
    assert (pool.executor, pool.timeout_s, pool.workers) == ("inline", 7.0, default_workers())
    assert 1 <= default_workers() <= 4
    with pytest.raises(ValueError):
        JudgePool(ScriptedJudger(), executor="gpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        JudgePool(ScriptedJudger(), workers=0)
    with pytest.raises(ValueError, match="fork"):
        JudgePool(ScriptedJudger(), executor="process", mp_context="fork")


def test_rlcli_judging_re_exports_the_pool():
    """``rlcli.judging`` is kept for plugins and docs: its names are the ones under ``rlcli.judgers``."""
    import rlcli.judging as compat
    from rlcli.judgers import calls, pool, processes

    assert compat.JudgePool is pool.JudgePool and compat.default_workers is pool.default_workers
    assert compat.normalize_reward is calls.normalize_reward and compat.Executor is pool.Executor
    assert (compat._Proc, compat._exit_reason, compat._exitcode) == (processes._Proc, processes._exit_reason, processes._exitcode)
    assert set(compat.__all__) == {"JudgePool", "default_workers", "normalize_reward"}
