"""A rollout that stops moving says where (rlcli.stall.StallWatchdog), and an agent loop's group
that takes longer than ``agent_loop.timeout_s`` fails instead of stalling the run."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import ClassVar

from rlcli.agent_loops.base import AgentLoop, AgentLoopConfig, run_group_isolated
from rlcli.stall import StallWatchdog, progressed
from rlcli.types import Sample, SampleParams, Status


def _run(loop, coro, **kw):
    dog = StallWatchdog(loop, "test", **kw).start()
    try:
        return loop.run_until_complete(coro)
    finally:
        dog.stop()


def blocks_the_loop_with_a_sleep():
    time.sleep(0.8)


def test_a_blocked_loop_is_named_with_the_code_that_blocks_it(caplog):
    async def main():
        await asyncio.sleep(0.1)  # the loop turns once: the watchdog learns its thread
        blocks_the_loop_with_a_sleep()
        await asyncio.sleep(0.2)

    loop = asyncio.new_event_loop()
    with caplog.at_level(logging.WARNING, logger="rlcli.stall"):
        _run(loop, main(), blocked_s=0.3, idle_s=100)
    loop.close()
    text = caplog.text
    assert "the test event loop has not run for" in text
    assert "blocks_the_loop_with_a_sleep" in text and "time.sleep(0.8)" in text
    assert "asyncio.to_thread" in text and "the test event loop runs again, after" in text


async def never_answers():
    await asyncio.Event().wait()


def test_no_progress_lists_where_the_tasks_wait(caplog):
    async def main():
        waiting = [asyncio.ensure_future(never_answers()) for _ in range(3)]
        await asyncio.sleep(0.9)
        for t in waiting:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)

    loop = asyncio.new_event_loop()
    with caplog.at_level(logging.WARNING, logger="rlcli.stall"):
        _run(loop, main(), blocked_s=100, idle_s=0.3)
    loop.close()
    assert "no test group has finished for" in caplog.text
    assert "3 task(s) at" in caplog.text and "in never_answers" in caplog.text
    assert "has not run for" not in caplog.text


def test_a_moving_loop_and_a_loop_between_phases_draw_no_warning(caplog):
    async def busy():
        for _ in range(30):
            progressed()
            await asyncio.sleep(0.02)

    loop = asyncio.new_event_loop()
    dog = StallWatchdog(loop, "test", blocked_s=0.2, idle_s=0.2).start()
    with caplog.at_level(logging.WARNING, logger="rlcli.stall"):
        loop.run_until_complete(busy())
        time.sleep(0.6)  # not running (the trainer's phase): nothing to watch
        loop.run_until_complete(busy())
    dog.stop()
    loop.close()
    assert caplog.text == ""


class Hanging(AgentLoop):
    name: ClassVar[str] = "hanging"

    def __init__(self, timeout_s):
        super().__init__(AgentLoopConfig(sample_params=SampleParams(max_tokens=8), timeout_s=timeout_s),
                         backend=None, judge_pool=None, tokenizer=None, eos_token_ids=[2], seed=0)
        self.cancelled = 0

    async def run_sample(self, sample: Sample) -> Sample:
        if sample.uid == 1:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        sample.response_ids, sample.response_mask, sample.token_versions = [5], [1], [0]
        sample.status, sample.reward = Status.COMPLETED, {"score": 1.0}
        return sample


def test_a_group_past_the_timeout_fails_and_its_work_is_cancelled():
    loop = Hanging(timeout_s=0.2)
    samples = [Sample(uid=i, group_id=0, task_name="t", prompt_ids=[1, 2]) for i in range(3)]
    t0 = time.monotonic()
    asyncio.run(run_group_isolated(loop, samples))
    assert time.monotonic() - t0 < 5
    assert [s.status for s in samples] == [Status.COMPLETED, Status.FAILED, Status.COMPLETED]
    assert "agent_loop.timeout_s=0.2 s" in samples[1].error and loop.cancelled == 1
    assert loop.pop_stats()["agent_loop/errors"] == 1


def test_without_a_timeout_a_group_runs_as_long_as_it_takes():
    class Slow(Hanging):
        async def run_sample(self, sample):
            await asyncio.sleep(0.3)
            sample.response_ids, sample.response_mask, sample.token_versions = [5], [1], [0]
            sample.status, sample.reward = Status.COMPLETED, {"score": 1.0}
            return sample

    samples = [Sample(uid=i, group_id=0, task_name="t", prompt_ids=[1, 2]) for i in range(2)]
    asyncio.run(run_group_isolated(Slow(timeout_s=None), samples))
    assert all(s.status == Status.COMPLETED for s in samples)
