"""``batch_requests``: the backend's batched path over the CPU stand-in for SGLang (fake_sglang.py).

The fake's tokens and logprobs are exact functions of the token ids, so a batched response must
equal the one-request-per-call response token for token. ``generate_calls`` records each
``generate_request`` call's batch size (None: a single request)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from fake_sglang import FakeSGLangBackend, context, token_logprob

from rlcli.backends.base import GenerateRequest
from rlcli.testing.engine_plugins import fake_expected
from rlcli.types import SampleParams


@pytest.fixture
def backend(tiny_qwen2):
    be = FakeSGLangBackend(FakeSGLangBackend.Config(batch_requests=True), context(tiny_qwen2, eos=2, version=1))
    yield be
    be.shutdown()


def gen(be, prompt, **params):
    return be.generate(GenerateRequest(list(prompt), SampleParams(**params)))


def expected(be, prompt, n):
    return fake_expected(prompt, n, be.model_info.vocab_size, be.tm.shift)


def mixed(be) -> list[tuple[list[int], dict]]:
    """16 requests: lengths, engine stops (EOS and stop ids), greedy and sampled, min_tokens."""
    reqs = []
    for i in range(16):
        prompt = [3 + i % 7, 1 + i, 9]
        params = dict(max_tokens=4 + i, temperature=0.0 if i % 2 else 1.0)
        if i % 4 == 1:
            params["stop_token_ids"] = [expected(be, prompt, 3)[2]]  # stops by the third token
        elif i % 4 == 2:
            params["ignore_eos"] = True
        elif i % 4 == 3:
            params.update(min_tokens=3, stop_token_ids=[expected(be, prompt, 1)[0]])  # two phases
        reqs.append((prompt, params))
    return reqs


def run_all(be, reqs):
    async def main():
        return await asyncio.gather(*(gen(be, p, **kw) for p, kw in reqs))

    return asyncio.run(main())


def test_the_option_is_off_by_default_and_a_runtime_switch(tiny_qwen2):
    be = FakeSGLangBackend(FakeSGLangBackend.Config(), context(tiny_qwen2))
    try:
        assert be.batch_requests is False
        run_all(be, [([1, 2], dict(max_tokens=3))] * 3)
        assert be.tm.generate_calls == [None] * 3
        be.batch_requests = True
        run_all(be, [([1, 2], dict(max_tokens=3))] * 3)
        assert be.tm.generate_calls[3:] == [3]
    finally:
        be.shutdown()


def test_concurrent_requests_become_one_batch_with_the_single_request_outputs(backend):
    reqs = mixed(backend)
    backend.batch_requests = False
    alone = run_all(backend, reqs)
    assert backend.tm.generate_calls == [None] * 20  # 4 requests of two phases
    backend.tm.generate_calls.clear()
    backend.batch_requests = True
    batched = run_all(backend, reqs)
    # one batch of the 16 first phases, then one of the 4 second min_tokens phases
    assert backend.tm.generate_calls == [16, 4]
    assert {o.finish_reason for o in batched} == {"stop", "length"}
    for a, b in zip(alone, batched):
        assert (b.token_ids, b.logprobs, b.versions, b.finish_reason, b.error) == (
            a.token_ids, a.logprobs, a.versions, a.finish_reason, a.error)
        assert b.logprobs == [token_logprob(t) for t in b.token_ids]
    sent = backend.tm.requests[-20:]
    assert not any(r.stream for r in sent) and len({r.rid for r in sent}) == 20


def test_a_batch_asks_logprobs_only_for_the_requests_that_want_them(backend):
    reqs = [([4, i], dict(max_tokens=5, ignore_eos=True, return_logprob=i % 2 == 0)) for i in range(1, 7)]
    outs = run_all(backend, reqs)
    assert backend.tm.generate_calls == [6]
    assert [r.return_logprob for r in backend.tm.requests[-6:]] == [i % 2 == 0 for i in range(1, 7)]
    for (prompt, kw), out in zip(reqs, outs):
        assert out.token_ids == expected(backend, prompt, 5) and out.finish_reason == "length"
        assert out.logprobs == ([token_logprob(t) for t in out.token_ids] if kw["return_logprob"] else [])


def test_a_refused_request_fails_alone_and_the_rest_are_sent_one_by_one(backend):
    # rlcli lets this prompt through (it fits max_model_len); SGLang refuses it, failing the whole batch
    too_long = [5] * (backend.max_model_len - 3)
    good = [([4, i], dict(max_tokens=6, ignore_eos=True)) for i in range(1, 8)]
    outs = run_all(backend, good[:3] + [(too_long, dict(max_tokens=50, ignore_eos=True))] + good[3:])
    assert backend.tm.generate_calls == [8] + [None] * 8
    assert all(r.rid.endswith(".alone") for r in backend.tm.requests[-8:])  # new rids for the second try
    bad = outs.pop(3)
    assert bad.finish_reason == "error" and "maximum allowed length" in bad.error and bad.token_ids == []
    for (prompt, _), out in zip(good, outs):
        assert out.finish_reason == "length" and out.token_ids == expected(backend, prompt, 6)


def test_pause_during_a_batch_returns_partial_responses(backend):
    prompts = [[1, 2, i] for i in range(8)]

    async def main():
        tasks = [asyncio.ensure_future(gen(backend, p, max_tokens=500, ignore_eos=True, temperature=0.0))
                 for p in prompts]
        await asyncio.sleep(0.1)
        backend.pause()
        parts = await asyncio.wait_for(asyncio.gather(*tasks), 5)
        late = await gen(backend, [1, 2], max_tokens=3)
        backend.resume()
        return parts, late

    parts, late = asyncio.run(main())
    assert backend.tm.generate_calls == [8]
    for p, part in zip(prompts, parts):
        assert part.finish_reason == "abort" and 0 < len(part.token_ids) < 500
        assert part.token_ids == expected(backend, p, len(part.token_ids))
        assert part.logprobs == [token_logprob(t) for t in part.token_ids]
    assert late.finish_reason == "abort" and late.token_ids == []
    assert run_all(backend, [([1, 2], dict(max_tokens=3, ignore_eos=True))] * 2)[0].finish_reason == "length"


def cancel_the_first_of_four(be, first: int, max_tokens: int, after_s: float) -> list:
    """Four concurrent requests ``[first, i]``; the first one's caller is cancelled after ``after_s``."""

    async def main():
        tasks = [asyncio.ensure_future(gen(be, [first, i], max_tokens=max_tokens, ignore_eos=True)) for i in range(4)]
        await asyncio.sleep(after_s)
        tasks[0].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    return asyncio.run(main())


def test_a_cancelled_caller_aborts_its_request_alone(backend):
    outs = cancel_the_first_of_four(backend, 6, max_tokens=60, after_s=0.05)
    assert isinstance(outs[0], asyncio.CancelledError)
    assert backend.tm.generate_calls == [4] and ("abort_request", backend.tm.requests[0].rid) in backend.tm.calls
    assert [o.token_ids for o in outs[1:]] == [expected(backend, [6, i], 60) for i in range(1, 4)]


def test_a_request_cancelled_while_sglang_takes_the_batch_in_ends_the_batch(backend):
    # SGLang registers a batch's rids, then tokenizes; an abort meanwhile fails the whole batch
    # (RequestAbortedError): the others are then sent one by one
    tm = backend.tm
    serve = tm.generate_request

    async def slow_tokenization(obj, request=None):
        if isinstance(obj.input_ids[0], list):
            tm.live.update(obj.rid)
            await asyncio.sleep(0.5)
        async with contextlib.aclosing(serve(obj, request)) as outs:
            async for out in outs:
                yield out

    tm.generate_request = slow_tokenization
    outs = cancel_the_first_of_four(backend, 7, max_tokens=5, after_s=0.15)
    assert isinstance(outs[0], asyncio.CancelledError)
    assert tm.generate_calls == [4, None, None, None]
    assert [o.token_ids for o in outs[1:]] == [expected(backend, [7, i], 5) for i in range(1, 4)]


def test_a_request_aborted_while_queued_ends_at_once_unsent(backend):
    backend._flush = lambda turn: None  # the batch stays queued, as while more requests arrive

    async def main():
        task = asyncio.ensure_future(gen(backend, [1, 2], max_tokens=50, ignore_eos=True))
        while not backend._queued:  # the request reaches the plugin's queue on the engine thread
            await asyncio.sleep(0.005)
        t = time.perf_counter()
        backend.sleep(1)
        slept = time.perf_counter() - t
        backend.wake_up()
        return await task, slept

    out, slept = asyncio.run(main())
    assert out.finish_reason == "abort" and out.token_ids == [] and slept < 5
    assert backend.tm.generate_calls == []


def test_streamed_phases_go_alone(backend):
    # ignore_eos with stop ids: the plugin streams the request and stops it itself
    full = {i: expected(backend, [8, i], 30) for i in range(4)}
    streamed = [([8, i], dict(max_tokens=30, ignore_eos=True, stop_token_ids=[full[i][5]])) for i in range(4)]
    plain = [([8, i], dict(max_tokens=5, ignore_eos=True)) for i in range(4)]
    outs = run_all(backend, streamed + plain)
    calls = backend.tm.generate_calls
    assert calls.count(None) == 4 and [c for c in calls if c is not None] == [4]
    assert sum(r.stream for r in backend.tm.requests) == 4
    for i, out in enumerate(outs[:4]):
        cut = full[i].index(full[i][5])
        assert out.finish_reason == "stop" and out.token_ids == full[i][: cut + 1]
    assert [o.token_ids for o in outs[4:]] == [full[i][:5] for i in range(4)]
