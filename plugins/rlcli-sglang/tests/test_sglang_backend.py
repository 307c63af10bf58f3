"""The SGLang backend's own code paths over a CPU stand-in for SGLang's engine (fake_sglang.py):
phases, plugin-side stops, pause with partial tokens, weight updates and memory release tags,
shutdown that spares other child processes, the float32 refusal.

The contexts are bfloat16, like a real SGLang run. The dtype is incidental here: the fake engine's
tokens and logprobs are exact functions of the token ids (no model math), so nothing is loosened."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest
import torch
from fake_sglang import FakeSGLangBackend, context, token_logprob
from transformers import AutoModelForCausalLM

from rlcli.backends.base import GenerateRequest, RolloutWorkload
from rlcli.testing.engine_plugins import fake_expected
from rlcli.types import SampleParams


@pytest.fixture
def backend(tiny_qwen2):
    be = FakeSGLangBackend(FakeSGLangBackend.Config(), context(tiny_qwen2, eos=2, version=1))
    yield be
    be.shutdown()


def gen(be, prompt, seed=None, **params):
    return be.generate(GenerateRequest(list(prompt), SampleParams(**params), seed=seed))


def expected(be, prompt, n, shift=0):
    return fake_expected(prompt, n, be.model_info.vocab_size, shift)


def test_generate_returns_tokens_logprobs_versions_on_the_engine_thread(backend):
    out = asyncio.run(gen(backend, [5, 6], max_tokens=7, ignore_eos=True))
    assert out.token_ids == expected(backend, [5, 6], 7) and out.finish_reason == "length"
    assert out.logprobs == [token_logprob(t) for t in out.token_ids] and out.versions == [1] * 7
    assert threading.get_ident() not in backend.tm.thread_ids
    req = backend.tm.requests[-1]
    assert req.input_ids == [5, 6] and req.stream is False and req.sampling_params["ignore_eos"] is True
    assert "sampling_seed" not in req.sampling_params  # use_request_seeds is off by default
    assert req.return_logprob is True


def test_without_return_logprob_sglang_is_asked_for_none(backend):
    """The same tokens come back, read from ``output_ids``; SGLang was not asked for logprobs (it
    then skips their computation and its per-token bookkeeping)."""
    out = asyncio.run(gen(backend, [5, 6], max_tokens=7, ignore_eos=True))
    bare = asyncio.run(gen(backend, [5, 6], max_tokens=7, ignore_eos=True, return_logprob=False))
    assert bare.token_ids == out.token_ids and bare.logprobs == [] and bare.versions == [1] * 7
    assert bare.finish_reason == "length" and backend.tm.requests[-1].return_logprob is False
    stop = expected(backend, [3, 3], 1)[0]
    stopped = asyncio.run(gen(backend, [3, 3], max_tokens=9, stop_token_ids=[stop], return_logprob=False))
    assert stopped.token_ids == [stop] and stopped.finish_reason == "stop" and stopped.logprobs == []


def test_streamed_request_without_return_logprob_still_reads_logprob_entries(backend):
    """ignore_eos with stop ids streams; the plugin reads a stream's tokens from the logprob
    entries (output_ids can hold only the last token), so it asks for them and drops them."""
    toks = expected(backend, [5, 6], 4)
    cut = toks.index(toks[3])
    out = asyncio.run(gen(backend, [5, 6], max_tokens=9, ignore_eos=True, stop_token_ids=[toks[3]],
                          return_logprob=False))
    req = backend.tm.requests[-1]
    assert req.stream is True and req.return_logprob is True
    assert out.token_ids == toks[: cut + 1] and out.finish_reason == "stop" and out.logprobs == []


def test_engine_stops_include_eos_and_the_stop_token_is_returned(backend):
    first = expected(backend, [3, 3], 1)[0]
    out = asyncio.run(gen(backend, [3, 3], max_tokens=9, stop_token_ids=[first]))
    assert out.token_ids == [first] and out.finish_reason == "stop"
    assert backend.tm.requests[-1].sampling_params["stop_token_ids"] == [2, first]


def test_ignore_eos_with_stop_ids_is_stopped_by_the_plugin(backend):
    full = expected(backend, [8, 1], 30)
    j = 5
    stop = full[j]
    cut = full.index(stop)
    out = asyncio.run(gen(backend, [8, 1], max_tokens=30, ignore_eos=True, stop_token_ids=[stop]))
    assert out.token_ids == full[: cut + 1] and out.finish_reason == "stop"
    assert out.logprobs == [token_logprob(t) for t in out.token_ids]
    assert backend.tm.requests[-1].stream and ("abort_request", backend.tm.requests[-1].rid) in backend.tm.calls


def test_min_tokens_runs_two_requests_and_never_stops_early(backend):
    first = expected(backend, [4], 1)[0]
    out = asyncio.run(gen(backend, [4], max_tokens=10, min_tokens=4, stop_token_ids=[first]))
    assert len(out.token_ids) >= 4 and first not in out.token_ids[:4] and 2 not in out.token_ids[:4]
    p1, p2 = backend.tm.requests[-2:]
    assert p1.sampling_params["max_new_tokens"] == 4 and p1.sampling_params["logit_bias"] == {
        "2": float("-inf"), str(first): float("-inf")}
    assert p2.input_ids == [4] + out.token_ids[:4] and p2.sampling_params["max_new_tokens"] == 6
    assert out.finish_reason in ("stop", "length") and len(out.logprobs) == len(out.token_ids)


def test_pause_aborts_by_rid_and_returns_partial_tokens(backend):
    async def main():
        task = asyncio.ensure_future(gen(backend, [1, 2], max_tokens=500, ignore_eos=True, temperature=0.0))
        await asyncio.sleep(0.1)
        backend.pause()
        part = await asyncio.wait_for(task, 5)
        late = await gen(backend, [1, 2], max_tokens=3)
        backend.resume()
        return part, late

    part, late = asyncio.run(main())
    assert part.finish_reason == "abort" and 0 < len(part.token_ids) < 500
    assert part.token_ids == expected(backend, [1, 2], len(part.token_ids))
    assert late.finish_reason == "abort" and late.token_ids == []
    assert asyncio.run(gen(backend, [1, 2], max_tokens=3, ignore_eos=True)).finish_reason == "length"


def test_an_abort_sglang_decides_alone_is_an_error(backend):
    orig = backend.tm.generate_request

    async def rejecting(obj, request=None):
        yield {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "KV cache pool is full"}}}

    backend.tm.generate_request = rejecting
    out = asyncio.run(gen(backend, [1], max_tokens=3))
    assert out.finish_reason == "error" and "KV cache pool is full" in out.error
    backend.tm.generate_request = orig


def _named(model_dir, scale):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return [(n, t * scale) for n, t in model.state_dict().items()]


def test_update_weights_awake_flushes_the_cache(backend, tiny_qwen2):
    with pytest.raises(ValueError, match="unknown tensor name"):
        backend.update_weights([("nope", torch.zeros(1))], 5)
    backend.update_weights(_named(tiny_qwen2, 0.5), 5)
    assert backend.tm.calls[-2:] == [("flush_cache", 120.0), ("update_weights_from_tensor", True)]
    assert "lm_head.weight" not in backend.tm.loaded and backend.version == 5
    out = asyncio.run(gen(backend, [9], max_tokens=4, ignore_eos=True))
    assert out.versions == [5] * 4 and out.token_ids == expected(backend, [9], 4, shift=backend.tm.shift)


def test_sleep_levels_release_tags_and_updates_while_asleep_resume_weights_first(backend, tiny_qwen2):
    backend.sleep(1)
    backend.wake_up()
    backend.sleep(2)
    backend.update_weights(_named(tiny_qwen2, 3.0), 6)
    backend.wake_up()
    mem = [c for c in backend.tm.calls if c[0] in ("release", "resume", "update_weights_from_tensor", "flush_cache")]
    assert mem == [
        ("flush_cache", 120.0), ("release", ("kv_cache",)), ("resume", ("kv_cache",)),
        ("flush_cache", 120.0), ("release", ("kv_cache", "weights", "cuda_graph")),
        ("flush_cache", 120.0), ("resume", ("weights",)), ("update_weights_from_tensor", True),
        ("resume", ("cuda_graph", "kv_cache")),
    ]
    assert asyncio.run(gen(backend, [2], max_tokens=2, ignore_eos=True)).versions == [6, 6]


def test_requests_made_while_asleep_wait_for_wake_up(backend):
    async def main():
        running = asyncio.ensure_future(gen(backend, [6], max_tokens=400, ignore_eos=True))
        await asyncio.sleep(0.05)
        backend.sleep(1)
        first = await asyncio.wait_for(running, 5)
        queued = asyncio.ensure_future(gen(backend, [6], max_tokens=3, ignore_eos=True))
        await asyncio.sleep(0.1)
        assert not queued.done()
        backend.wake_up()
        return first, await asyncio.wait_for(queued, 5)

    first, queued = asyncio.run(main())
    assert first.finish_reason == "abort" and queued.finish_reason == "length"


def test_a_float32_run_is_refused_before_the_engine_starts(tiny_qwen2):
    # SGLang 0.5.17's scheduler dies on float32 (sgl-kernel RMSNorm) and its watchdog SIGQUITs rlcli
    from fake_sglang import FakeEngine

    FakeEngine.last = None
    with pytest.raises(ValueError, match=r"model\.dtype: bfloat16 \(or float16\)"):
        FakeSGLangBackend(FakeSGLangBackend.Config(), context(tiny_qwen2, dtype=torch.float32))
    assert FakeEngine.last is None  # no engine (no scheduler process) was built


def test_shutdown_stops_the_watchdog_and_never_calls_engine_shutdown(tiny_qwen2):
    be = FakeSGLangBackend(FakeSGLangBackend.Config(), context(tiny_qwen2))
    tm = be.tm
    be.shutdown()  # FakeEngine.shutdown() raises if called
    assert ("watchdog_stop",) in tm.calls
    assert asyncio.run(gen(be, [1], max_tokens=2)).finish_reason == "error"


def test_a_stop_id_sampled_as_the_last_allowed_token_is_a_stop(backend):
    # SGLang checks max_new_tokens before stop ids and answers "length" there
    full = expected(backend, [7, 3], 30)
    n = next(i for i in range(2, 30) if full[i - 1] not in full[: i - 1] and 2 not in full[:i])
    out = asyncio.run(gen(backend, [7, 3], max_tokens=n, stop_token_ids=[full[n - 1]]))
    assert out.token_ids == full[:n] and out.finish_reason == "stop"


def test_context_length_is_what_sglang_serves(backend):
    # SGLang clips max_new_tokens to context_len - 2 - prompt: the backend's max_model_len says so
    assert backend.max_model_len == backend.tm.context_len - 2
    prompt = [5] * (backend.max_model_len - 3)
    out = asyncio.run(gen(backend, prompt, max_tokens=50, ignore_eos=True))
    assert out.finish_reason == "error" and "maximum allowed length" in out.error  # SGLang's own refusal
    ok = asyncio.run(gen(backend, [5] * 10, max_tokens=backend.max_model_len, ignore_eos=True))
    assert ok.finish_reason == "length" and len(ok.token_ids) == backend.max_model_len - 10


def test_pause_of_a_streamed_request_keeps_the_streamed_tokens(backend):
    # SGLang's answer to an abort of a queued streamed request holds only the last output id
    backend.tm.abort_echo = True

    async def main():
        task = asyncio.ensure_future(gen(backend, [1, 2], max_tokens=500, ignore_eos=True, temperature=0.0,
                                         stop_token_ids=[backend.model_info.vocab_size + 7]))
        await asyncio.sleep(0.1)
        backend.pause()
        part = await asyncio.wait_for(task, 5)
        backend.resume()
        return part

    part = asyncio.run(main())
    assert backend.tm.requests[-1].stream
    assert part.finish_reason == "abort" and 1 < len(part.token_ids) < 500
    assert part.token_ids == expected(backend, [1, 2], len(part.token_ids))
    assert part.logprobs == [token_logprob(t) for t in part.token_ids]


def test_auto_sizes_the_kv_pool_from_the_workload_and_a_share_goes_through(tiny_qwen2):
    from fake_sglang import FakeEngine

    workload = RolloutWorkload(max_sequences=40, max_sequence_tokens=37)

    def engine_kw(**options):
        be = FakeSGLangBackend(FakeSGLangBackend.Config(**options), replace(context(tiny_qwen2), workload=workload))
        be.shutdown()
        return FakeEngine.last.kwargs

    kw = engine_kw()
    assert kw["max_total_tokens"] == 40 * 37 + 148  # pages of 1 token; +10 %
    assert kw["mem_fraction_static"] == 0.9  # only a ceiling once the pool has a size
    assert kw["max_running_requests"] == 40  # the recipe's sequences in flight decode in one wave
    # max_batch_size bounds the sequences in flight; one max_model_len (512) sequence is the floor
    bounded = engine_kw(max_batch_size=8)
    assert bounded["max_total_tokens"] == 513 + 52 and bounded["max_running_requests"] == 8
    explicit = engine_kw(mem_fraction_static=0.3)
    assert explicit["mem_fraction_static"] == 0.3 and "max_total_tokens" not in explicit
    assert explicit["max_running_requests"] == 40
