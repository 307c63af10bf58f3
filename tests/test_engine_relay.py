"""The engine runtime's relay: calls from callers' event loops run on the engine loop, handed over
once per loop turn each way, with results, errors and cancellation carried across."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rlcli.backends.engine_runtime.loop import EngineLoop
from rlcli.backends.engine_runtime.relay import EngineStopped, Relay


@pytest.fixture
def engine():
    loop = EngineLoop("relay-test")
    loop.start()
    yield loop
    loop.stop()


class Counting(Relay):
    """Counts the hand-overs each way."""

    def __init__(self, engine):
        super().__init__(engine)
        self.starts, self.returns = [], 0

    def _start(self, batch):
        self.starts.append(len(batch))
        super()._start(batch)

    def _return(self):
        self.returns += 1
        super()._return()


def test_one_turns_calls_cross_once_each_way_with_their_results(engine):
    relay = Counting(engine)
    seen = []

    async def work(i):
        seen.append(threading.current_thread().name)
        await asyncio.sleep(0.01)
        return i * i

    async def main():
        return await asyncio.gather(*(relay.run(lambda i=i: work(i)) for i in range(64)))

    assert asyncio.run(main()) == [i * i for i in range(64)]
    assert relay.starts == [64] and relay.returns <= 2  # the 64 finish in one or two engine turns
    assert set(seen) == {"relay-test"}


def test_errors_reach_their_caller_alone(engine):
    relay = Relay(engine)

    async def work(i):
        if i == 1:
            raise ValueError("boom")
        return i

    def broken():
        raise KeyError("no coroutine")

    async def main():
        calls = [relay.run(lambda i=i: work(i)) for i in range(3)] + [relay.run(broken), relay.run(lambda: work(3))]
        return await asyncio.gather(*calls, return_exceptions=True)

    out = asyncio.run(main())
    assert out[0] == 0 and out[2] == 2 and out[4] == 3
    assert isinstance(out[1], ValueError) and str(out[1]) == "boom" and isinstance(out[3], KeyError)


def test_a_cancelled_caller_cancels_its_task_on_the_engine_loop(engine):
    relay = Relay(engine)
    started, cancelled = threading.Event(), threading.Event()

    async def work():
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def main():
        task = asyncio.ensure_future(relay.run(work))
        other = asyncio.ensure_future(relay.run(lambda: asyncio.sleep(0.05, result="kept")))
        while not started.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await other

    assert asyncio.run(main()) == "kept"
    assert cancelled.wait(5)


def test_a_call_cancelled_before_it_crossed_never_starts(engine):
    relay = Relay(engine)
    made = []

    async def main():
        task = asyncio.ensure_future(relay.run(lambda: made.append(1) or asyncio.sleep(0)))
        await asyncio.sleep(0)  # run() has queued the call; the hand-over is the next callback
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await relay.run(lambda: asyncio.sleep(0))  # the engine loop has taken the earlier hand-over

    asyncio.run(main())
    assert made == []


def test_callers_on_several_threads_get_their_own_results(engine):
    relay = Relay(engine)
    results = {}

    def caller(k):
        async def main():
            return await asyncio.gather(*(relay.run(lambda i=i: asyncio.sleep(0.001, result=(k, i)))
                                          for i in range(20)))
        results[k] = asyncio.run(main())

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {k: [(k, i) for i in range(20)] for k in range(4)}


def test_a_stopped_engine_answers_engine_stopped_without_making_the_coroutine(engine):
    relay = Relay(engine)
    engine.stop()
    made = []

    async def main():
        return await relay.run(lambda: made.append(1) or asyncio.sleep(0))

    with pytest.raises(EngineStopped, match="relay-test engine thread has stopped"):
        asyncio.run(main())
    assert made == []
