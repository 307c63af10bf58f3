"""The LMDeploy backend's own code paths over a CPU stand-in for LMDeploy's engine
(fake_lmdeploy.py): instance pool, stream parsing, cancel with partial tokens, weight loading
(also while asleep), sleep tags, shutdown."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest
import torch
from fake_lmdeploy import FakeLMDeployBackend, context, token_logprob
from transformers import AutoModelForCausalLM

from rlcli.backends.base import GenerateRequest, RolloutWorkload
from rlcli.testing.engine_plugins import fake_expected
from rlcli.types import SampleParams


@pytest.fixture
def backend(tiny_qwen2):
    be = FakeLMDeployBackend(FakeLMDeployBackend.Config(), context(tiny_qwen2, eos=2, version=2))
    yield be
    be.shutdown()


def gen(be, prompt, seed=None, **params):
    return be.generate(GenerateRequest(list(prompt), SampleParams(**params), seed=seed))


def expected(be, prompt, n, shift=0):
    return fake_expected(prompt, n, be.model_info.vocab_size, shift)


def test_generate_streams_deltas_with_their_logprobs(backend):
    out = asyncio.run(gen(backend, [4, 5], max_tokens=6, ignore_eos=True, seed=11))
    assert out.token_ids == expected(backend, [4, 5], 6) and out.finish_reason == "length"
    assert out.logprobs == [token_logprob(t) for t in out.token_ids] and out.versions == [2] * 6
    session, prompt, gc = backend.fake.requests[-1]
    assert prompt == [4, 5] and gc.random_seed == 11 and gc.stop_token_ids is None
    assert backend.fake.ended[-1] == session  # the stream's own cleanup (end session) ran
    assert threading.get_ident() not in backend.fake.thread_ids


def test_without_return_logprob_lmdeploy_is_asked_for_none(backend):
    out = asyncio.run(gen(backend, [4, 5], max_tokens=6, ignore_eos=True, seed=11, return_logprob=False))
    assert out.token_ids == expected(backend, [4, 5], 6) and out.finish_reason == "length"
    assert out.logprobs == [] and out.versions == [2] * 6
    assert backend.fake.requests[-1][2].logprobs is None


def test_stop_token_is_kept_and_finish_is_stop(backend):
    first = expected(backend, [7], 1)[0]
    out = asyncio.run(gen(backend, [7], max_tokens=9, stop_token_ids=[first]))
    assert out.token_ids == [first] and out.finish_reason == "stop"
    assert backend.fake.requests[-1][2].stop_token_ids == [2, first]
    out = asyncio.run(gen(backend, [7], max_tokens=9, min_tokens=3, stop_token_ids=[first]))
    assert first not in out.token_ids[:3] and len(out.token_ids) >= 3


def test_instance_pool_bounds_concurrency(backend):
    async def main():
        return await asyncio.gather(*(gen(backend, [i + 1], max_tokens=3, ignore_eos=True) for i in range(20)))

    outs = asyncio.run(main())
    assert all(o.finish_reason == "length" and len(o.token_ids) == 3 for o in outs)
    assert backend._pool.qsize() == 8  # every instance went back


@pytest.mark.parametrize("unscored_tail", [False, True])
def test_pause_cancels_sessions_and_returns_partial_tokens(backend, unscored_tail):
    backend.fake.cancel_with_unscored_token = unscored_tail

    async def main():
        task = asyncio.ensure_future(gen(backend, [1, 1], max_tokens=500, ignore_eos=True, temperature=0.0))
        await asyncio.sleep(0.1)
        backend.pause()
        part = await asyncio.wait_for(task, 5)
        late = await gen(backend, [1, 1], max_tokens=3)
        backend.resume()
        return part, late

    part, late = asyncio.run(main())
    assert part.finish_reason == "abort" and 0 < len(part.token_ids) < 500
    assert part.token_ids == expected(backend, [1, 1], len(part.token_ids))  # a tail token without logprob is dropped
    assert len(part.logprobs) == len(part.token_ids)
    assert late.finish_reason == "abort" and late.token_ids == []
    assert any(c[0] == "cancel" for c in backend.fake.calls)


def _named(model_dir, scale):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return [(n, t * scale) for n, t in model.state_dict().items()]


def test_update_weights_loads_in_place_then_finalizes(backend, tiny_qwen2):
    with pytest.raises(ValueError, match="unknown tensor name"):
        backend.update_weights([("model.nope", torch.zeros(1))], 4)
    backend.update_weights(_named(tiny_qwen2, 0.5), 4)
    assert backend.fake.calls[-2:] == [("load", "rlcli update_weights"), ("finalize",)]
    assert "lm_head.weight" not in backend.fake.loaded
    out = asyncio.run(gen(backend, [3], max_tokens=4, ignore_eos=True))
    assert out.versions == [4] * 4 and out.token_ids == expected(backend, [3], 4, shift=backend.fake.shift)


def test_sleep_both_levels_offload_and_updates_while_asleep_wake_weights_first(backend, tiny_qwen2):
    backend.sleep(2)
    backend.update_weights(_named(tiny_qwen2, 2.0), 5)
    backend.wake_up()
    backend.sleep(1)
    backend.wake_up()
    seq = [c for c in backend.fake.calls if c[0] in ("sleep", "wakeup", "load")]
    assert seq == [("sleep", 1), ("wakeup", ("weights",)), ("load", "rlcli update_weights"),
                   ("wakeup", ("kv_cache",)), ("sleep", 1), ("wakeup", None)]
    assert asyncio.run(gen(backend, [3], max_tokens=2, ignore_eos=True)).versions == [5, 5]


def test_temperature_above_two_is_an_error_before_the_engine(backend):
    n = len(backend.fake.requests)
    out = asyncio.run(gen(backend, [3], max_tokens=2, temperature=2.5))
    assert out.finish_reason == "error" and "up to 2.0" in out.error and len(backend.fake.requests) == n


def test_shutdown_closes_the_engine(tiny_qwen2):
    be = FakeLMDeployBackend(FakeLMDeployBackend.Config(), context(tiny_qwen2))
    fake = be.fake
    be.shutdown()
    assert fake.calls[-1] == ("close",) and fake._loop_main.done()


def test_the_real_backend_refuses_cpu_and_multi_rank(tiny_qwen2):
    from rlcli_lmdeploy import LMDeployBackend

    with pytest.raises(ValueError, match="runs on CUDA GPUs"):
        LMDeployBackend(LMDeployBackend.Config(), context(tiny_qwen2))
    ctx = context(tiny_qwen2)
    ctx.world_size = 2
    with pytest.raises(ValueError, match="single-rank"):
        LMDeployBackend(LMDeployBackend.Config(), ctx)


def test_session_len_is_the_models_context_cut_to_the_kv_cache(tiny_qwen2, monkeypatch):
    be = FakeLMDeployBackend(FakeLMDeployBackend.Config(), context(tiny_qwen2))
    try:  # LMDeploy's Engine would otherwise allow as many tokens as its KV cache holds
        import logging

        assert logging.getLogger("lmdeploy").level == logging.WARNING  # LMDeploy's own default is INFO
        max_pos = be.model_info.max_position_embeddings
        assert be.fake.engine_config.session_len == max_pos and be.max_model_len == max_pos
    finally:
        be.shutdown()
    monkeypatch.setattr("fake_lmdeploy.FakeEngine.kv_tokens", 40)
    be = FakeLMDeployBackend(FakeLMDeployBackend.Config(max_model_len=64), context(tiny_qwen2))
    try:
        assert be.fake.engine_config.session_len == 64 and be.max_model_len == 40
        out = asyncio.run(gen(be, [3] * 40, max_tokens=4))
        assert out.finish_reason == "error" and "max_model_len is 40" in out.error
        out = asyncio.run(gen(be, [3] * 30, max_tokens=50, ignore_eos=True))
        assert out.finish_reason == "length" and len(out.token_ids) == 10
    finally:
        be.shutdown()


@pytest.mark.parametrize("read_every", [3, 7])
def test_coalesced_deltas_keep_tokens_and_logprobs_aligned(backend, read_every, monkeypatch):
    monkeypatch.setattr("fake_lmdeploy.FakeEngine.read_every", read_every)
    async def main():
        return await asyncio.wait_for(asyncio.gather(
            gen(backend, [4, 5], max_tokens=10, ignore_eos=True),  # FINISH carries several tokens
            gen(backend, [6], max_tokens=10, stop_token_ids=[expected(backend, [6], 5)[-1]]),
        ), 10)

    outs = asyncio.run(main())
    assert outs[0].token_ids == expected(backend, [4, 5], 10) and outs[0].finish_reason == "length"
    assert outs[0].logprobs == [token_logprob(t) for t in outs[0].token_ids]
    stop_at = expected(backend, [6], 5)
    assert outs[1].token_ids == stop_at[: stop_at.index(stop_at[-1]) + 1] and outs[1].finish_reason == "stop"
    assert outs[1].logprobs == [token_logprob(t) for t in outs[1].token_ids]


def test_cancel_answer_carries_the_unread_tokens_with_their_logprobs(backend, monkeypatch):
    monkeypatch.setattr("fake_lmdeploy.FakeEngine.read_every", 1000)  # nothing read before the cancel

    async def main():
        task = asyncio.ensure_future(gen(backend, [2, 3], max_tokens=500, ignore_eos=True))
        await asyncio.sleep(0.1)
        backend.pause()
        return await asyncio.wait_for(task, 5)

    part = asyncio.run(main())
    assert part.finish_reason == "abort" and 0 < len(part.token_ids) < 500
    assert part.token_ids == expected(backend, [2, 3], len(part.token_ids))
    assert part.logprobs == [token_logprob(t) for t in part.token_ids]


def test_a_cancelled_caller_ends_its_session(backend):
    async def main():
        task = asyncio.ensure_future(gen(backend, [1, 2], max_tokens=500, ignore_eos=True))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    for _ in range(200):
        if backend.fake.running == 0:
            break
        threading.Event().wait(0.01)
    session = backend.fake.requests[-1][0]
    assert backend.fake.ended[-1] == session and not backend.fake.sessions  # the stream's own cleanup
    assert backend.fake.running == 0 and backend._pool.qsize() == 8


def test_a_failure_between_outputs_cancels_the_sequence_then_ends_the_session(backend, monkeypatch):
    import rlcli_lmdeploy.backend as backend_module

    real, seen = backend_module.token_logprobs, []

    def flaky(ids, logprobs):
        seen.append(ids)
        if len(seen) == 3:
            raise RuntimeError("boom")
        return real(ids, logprobs)

    monkeypatch.setattr(backend_module, "token_logprobs", flaky)
    out = asyncio.run(gen(backend, [1, 2], max_tokens=500, ignore_eos=True))
    assert out.finish_reason == "error" and "boom" in out.error
    session = backend.fake.requests[-1][0]
    assert ("cancel", session) in backend.fake.calls and backend.fake.ended[-1] == session
    assert backend.fake.running == 0 and not backend.fake.sessions and backend._pool.qsize() == 8


def test_environment_check_runs_once_and_a_failed_check_raises(tiny_qwen2, monkeypatch):
    import fake_lmdeploy

    import rlcli_lmdeploy.backend as backend_module

    monkeypatch.setattr(backend_module, "_ENV_CHECK_PASSED", False)
    monkeypatch.setattr(fake_lmdeploy.FakeEngine, "env_checks", 0)
    monkeypatch.setattr(fake_lmdeploy.FakeEngine, "check_env_fails", True)
    with pytest.raises(RuntimeError, match="environment check failed"):  # not SystemExit
        FakeLMDeployBackend(FakeLMDeployBackend.Config(), context(tiny_qwen2))
    monkeypatch.setattr(fake_lmdeploy.FakeEngine, "check_env_fails", False)
    for _ in range(2):
        FakeLMDeployBackend(FakeLMDeployBackend.Config(), context(tiny_qwen2)).shutdown()
    assert fake_lmdeploy.FakeEngine.env_checks == 2  # the failed one, then the first good one only
    assert fake_lmdeploy.ENVS.enable_check_env is True  # LMDeploy's switch is left as it was


def test_unknown_engine_kwargs_fail_at_start_with_the_option_named(tiny_qwen2):
    with pytest.raises(ValueError, match="rollout.engine_kwargs.*no_such_field"):
        FakeLMDeployBackend(FakeLMDeployBackend.Config(engine_kwargs={"no_such_field": 1}), context(tiny_qwen2))


def test_the_engines_logits_are_upcast_to_float32_unless_disabled(backend, tiny_qwen2):
    hidden = torch.randn(3, 8)
    agent = backend.fake.executor.model_agent
    assert agent.get_logits(hidden).dtype == torch.float32  # logprobs are computed from these
    other = FakeLMDeployBackend(FakeLMDeployBackend.Config(float32_logits=False), context(tiny_qwen2))
    try:
        assert other.fake.executor.model_agent.get_logits(hidden).dtype == torch.bfloat16
    finally:
        other.shutdown()


def test_a_malformed_logprob_fails_its_request_only(backend):
    backend.fake.drop_logprob_of_step = 3  # parsed when the request ends (deltas are kept until then)
    bad = asyncio.run(gen(backend, [4, 5], max_tokens=6, ignore_eos=True))
    assert bad.finish_reason == "error" and "lack the sampled token" in (bad.error or "")
    backend.fake.drop_logprob_of_step = None
    good = asyncio.run(gen(backend, [4, 5], max_tokens=6, ignore_eos=True))
    assert good.finish_reason == "length" and good.token_ids == expected(backend, [4, 5], 6)


class _TrackedList(list):
    """A list that can be weakly referenced (to see whether the plugin keeps it)."""


def test_stream_deltas_are_not_kept_after_they_are_parsed(backend, monkeypatch):
    """Kept deltas outlive garbage collections and make Python's full collections (which scan every
    live object of the process) run again and again on LMDeploy's loop: each delta's objects must
    be free once the next one comes."""
    import weakref

    import fake_lmdeploy

    alive: list[int] = []
    real = fake_lmdeploy.FakeInstance.async_stream_infer

    async def tracking(self, *args, **kwargs):
        refs = []
        async for out in real(self, *args, **kwargs):
            alive.append(sum(r() is not None for r in refs))
            if out.logprobs is not None:
                out.logprobs = _TrackedList(out.logprobs)
                refs.append(weakref.ref(out.logprobs))
            yield out

    monkeypatch.setattr(fake_lmdeploy.FakeInstance, "async_stream_infer", tracking)
    out = asyncio.run(gen(backend, [4, 5], max_tokens=20, ignore_eos=True))
    assert out.token_ids == expected(backend, [4, 5], 20)
    assert len(alive) == 20 and max(alive) <= 1, alive  # at most the delta just handed over


def test_auto_sizes_the_kv_cache_from_the_workload_and_a_share_goes_through(tiny_qwen2):
    workload = RolloutWorkload(max_sequences=40, max_sequence_tokens=37)

    def engine_config(**options):
        be = FakeLMDeployBackend(FakeLMDeployBackend.Config(**options), replace(context(tiny_qwen2), workload=workload))
        config, served = be.fake.engine_config, be.max_model_len
        be.shutdown()
        return config, served

    config, served = engine_config()
    # 37 tokens = 1 block of 64 per sequence; +10 %; + LMDeploy's reserved block
    assert config.num_gpu_blocks == 40 + 4 + 1 and config.cache_max_entry_count == 0.8  # LMDeploy's default
    assert served == 512  # the cache holds a whole max_model_len sequence: session_len is not cut
    assert config.max_batch_size == 40  # the recipe's sequences in flight decode in one wave
    # max_batch_size bounds the sequences in flight; one max_model_len (512 = 8 blocks) sequence is the floor
    bounded = engine_config(max_batch_size=2)[0]
    assert bounded.num_gpu_blocks == 9 + 1 + 1 and bounded.max_batch_size == 2
    explicit, _ = engine_config(cache_max_entry_count=0.3)
    assert explicit.cache_max_entry_count == 0.3 and explicit.num_gpu_blocks == 0
    assert explicit.max_batch_size == 40
