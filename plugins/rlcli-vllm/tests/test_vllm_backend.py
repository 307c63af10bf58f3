"""The vLLM backend's own code paths over a CPU stand-in for vLLM's ``LLMEngine`` (fake_vllm.py):
stepping, FINAL_ONLY outputs, pause with partial tokens read from the output processor, weight updates (also while asleep), sleep
tags, engine failures, shutdown."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest
import torch
from fake_vllm import FakeVLLMBackend, context, token_logprob
from transformers import AutoModelForCausalLM

from rlcli.backends.base import GenerateRequest, RolloutWorkload
from rlcli.testing.engine_plugins import fake_expected
from rlcli.types import SampleParams


@pytest.fixture
def backend(tiny_qwen2):
    be = FakeVLLMBackend(FakeVLLMBackend.Config(), context(tiny_qwen2, eos=2, version=3))
    yield be
    be.shutdown()


def gen(be, prompt, seed=None, **params):
    return be.generate(GenerateRequest(list(prompt), SampleParams(**params), seed=seed))


def expected(be, prompt, n, shift=0, stops=()):
    return fake_expected(prompt, n, be.model_info.vocab_size, shift, stops)


def test_generate_streams_tokens_logprobs_versions(backend):
    async def main():
        return await asyncio.gather(gen(backend, [5, 6, 7], max_tokens=12, ignore_eos=True),
                                    gen(backend, [8], max_tokens=5, ignore_eos=True, temperature=0.0))

    a, b = asyncio.run(main())
    assert a.token_ids == expected(backend, [5, 6, 7], 12) and a.finish_reason == "length"
    assert a.logprobs == [token_logprob(t) for t in a.token_ids]
    assert a.versions == [3] * 12 and b.versions == [3] * 5
    # every engine call happened on the plugin's engine thread, never on the caller's
    assert backend.fake.thread_ids and threading.get_ident() not in backend.fake.thread_ids


def test_stop_ids_and_eos_reach_vllm_as_stop_token_ids(backend):
    seen = {}
    orig = backend.fake.add_request

    def spy(rid, prompt, sp):
        seen[rid] = sp
        return orig(rid, prompt, sp)

    backend.fake.add_request = spy
    first = expected(backend, [9, 9], 1)[0]
    out = asyncio.run(gen(backend, [9, 9], max_tokens=8, stop_token_ids=[first]))
    assert out.token_ids == [first] and out.finish_reason == "stop"
    sp = next(iter(seen.values()))
    assert sp.stop_token_ids == [2, first] and sp.ignore_eos is True and sp.logprobs == 0
    assert sp.output_kind.name == "FINAL_ONLY"  # one output per request, as LLM.generate asks
    assert sp.seed is not None  # use_request_seeds: a seed is always passed
    out = asyncio.run(gen(backend, [9, 9], max_tokens=8, min_tokens=3, stop_token_ids=[first]))
    assert len(out.token_ids) >= 3 and first not in out.token_ids[:3]


def test_without_return_logprob_vllm_is_asked_for_none_and_returns_none(backend):
    seen = []
    orig = backend.fake.add_request

    def spy(rid, prompt, sp):
        seen.append(sp)
        return orig(rid, prompt, sp)

    backend.fake.add_request = spy

    async def main():
        full = await gen(backend, [5, 6, 7], max_tokens=12, ignore_eos=True, return_logprob=False)
        task = asyncio.ensure_future(gen(backend, [1, 2, 3], max_tokens=400, ignore_eos=True, temperature=0.0,
                                         return_logprob=False))
        await asyncio.sleep(0.1)
        backend.pause()
        part = await asyncio.wait_for(task, 5)
        backend.resume()
        return full, part

    full, part = asyncio.run(main())
    assert full.token_ids == expected(backend, [5, 6, 7], 12) and full.logprobs == [] and full.versions == [3] * 12
    assert part.finish_reason == "abort" and 0 < len(part.token_ids) < 400 and part.logprobs == []
    assert all(sp.logprobs is None and sp.flat_logprobs is False for sp in seen)  # vLLM's logprob path stays off


def test_pause_returns_partial_tokens_and_refuses_new_requests(backend):
    async def main():
        task = asyncio.ensure_future(gen(backend, [1, 2, 3], max_tokens=400, ignore_eos=True, temperature=0.0))
        await asyncio.sleep(0.1)
        backend.pause()
        part = await asyncio.wait_for(task, 5)
        late = await gen(backend, [1, 2, 3], max_tokens=4)
        backend.resume()
        rest = await gen(backend, [1, 2, 3] + part.token_ids, max_tokens=400 - len(part.token_ids),
                         ignore_eos=True, temperature=0.0)
        return part, late, rest

    part, late, rest = asyncio.run(main())
    assert part.finish_reason == "abort" and 0 < len(part.token_ids) < 400
    assert part.token_ids == expected(backend, [1, 2, 3], len(part.token_ids))
    assert len(part.logprobs) == len(part.versions) == len(part.token_ids)
    assert part.logprobs == pytest.approx([token_logprob(t) for t in part.token_ids])  # read before the abort
    assert late.finish_reason == "abort" and late.token_ids == []
    assert part.token_ids + rest.token_ids == expected(backend, [1, 2, 3], 400)
    assert any(c[0] == "abort_request" for c in backend.fake.calls)


def test_pause_aborts_every_request_even_when_one_partial_read_fails(backend):
    from types import SimpleNamespace

    async def main():
        a = asyncio.ensure_future(gen(backend, [1, 2, 3], max_tokens=400, ignore_eos=True, temperature=0.0))
        b = asyncio.ensure_future(gen(backend, [4, 5], max_tokens=400, ignore_eos=True, temperature=0.0))
        await asyncio.sleep(0.1)
        rid_a = next(rid for rid, r in backend.fake.requests.items() if r["prompt"] == [1, 2, 3])
        state = backend.fake.output_processor.request_states[backend.fake.requests[rid_a]["internal"]]
        state.logprobs_processor = SimpleNamespace(logprobs=None)  # a state the plugin cannot read
        backend.pause()
        out = await asyncio.wait_for(asyncio.gather(a, b), 5)
        backend.resume()
        return out

    a, b = asyncio.run(main())
    assert a.finish_reason == "error" and "partial output" in (a.error or "")
    assert b.finish_reason == "abort" and 0 < len(b.token_ids) < 400 and len(b.logprobs) == len(b.token_ids)
    aborted = [c[1] for c in backend.fake.calls if c[0] == "abort_request"]
    assert aborted and len(aborted[-1]) == 2  # both requests left the engine
    assert not backend.fake.requests


def _named(model_dir, scale):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return [(n, t * scale) for n, t in model.state_dict().items()]


def test_update_weights_checks_names_then_loads_and_resets_the_prefix_cache(backend, tiny_qwen2):
    named = _named(tiny_qwen2, 0.5)
    with pytest.raises(ValueError, match="no_such_weight"):
        backend.update_weights([("model.no_such_weight", torch.zeros(1))] + named, 9)
    assert backend.version == 3 and not any(c[0] == "collective_rpc" for c in backend.fake.calls)
    with pytest.raises(ValueError, match="shape mismatch"):
        backend.update_weights([(named[0][0], torch.zeros(3, 3))], 9)
    backend.update_weights(named, 9)
    assert backend.version == 9
    assert "lm_head.weight" not in backend.fake.loaded  # tied alias dropped next to the embedding
    assert backend.fake.calls[-2:] == [("collective_rpc", "rlcli_load_weights"), ("reset_prefix_cache",)]
    out = asyncio.run(gen(backend, [4, 4], max_tokens=6, ignore_eos=True))
    assert out.versions == [9] * 6 and out.token_ids == expected(backend, [4, 4], 6, shift=backend.fake.shift)
    # the tied alias alone is loaded under the canonical name
    backend.update_weights([("lm_head.weight", dict(named)["lm_head.weight"])], 10)
    assert backend.fake.loaded == ["model.embed_tokens.weight"]


def test_sleep_aborts_in_flight_and_queues_new_requests_until_wake_up(backend, tiny_qwen2):
    async def main():
        running = asyncio.ensure_future(gen(backend, [3, 1], max_tokens=500, ignore_eos=True))
        await asyncio.sleep(0.05)
        await asyncio.get_running_loop().run_in_executor(None, backend.sleep, 2)
        first = await asyncio.wait_for(running, 5)
        queued = asyncio.ensure_future(gen(backend, [3, 1], max_tokens=4, ignore_eos=True))
        await asyncio.sleep(0.1)
        assert not queued.done(), "a request was served while asleep"
        # weights pushed while asleep: vLLM wakes the weights only, the KV cache stays released
        await asyncio.get_running_loop().run_in_executor(None, backend.update_weights, _named(tiny_qwen2, 2.0), 4)
        assert not queued.done()
        backend.wake_up()
        return first, await asyncio.wait_for(queued, 5)

    first, queued = asyncio.run(main())
    assert first.finish_reason == "abort"
    assert queued.finish_reason == "length" and queued.versions == [4] * 4
    calls = [c for c in backend.fake.calls if c[0] in ("sleep", "wake_up", "collective_rpc")]
    assert calls == [("sleep", 1), ("wake_up", ("weights",)), ("collective_rpc", "rlcli_load_weights"),
                     ("wake_up", ("kv_cache",))]


def test_sleep_and_wake_without_update_wake_everything(backend):
    backend.sleep(1)
    backend.wake_up()
    backend.wake_up()  # awake already: nothing happens
    assert [c for c in backend.fake.calls if c[0] in ("sleep", "wake_up")] == [("sleep", 1), ("wake_up", None)]
    assert asyncio.run(gen(backend, [7], max_tokens=3, ignore_eos=True)).finish_reason == "length"
    with pytest.raises(ValueError, match="sleep level"):
        backend.sleep(3)


def test_shutdown_while_asleep_wakes_vllm_first(tiny_qwen2):
    # the kit's sleep_wake check fails (by design) between sleep() and wake_up(), then shuts down
    be = FakeVLLMBackend(FakeVLLMBackend.Config(), context(tiny_qwen2))
    be.sleep(1)
    be.shutdown()
    assert [c for c in be.fake.calls if c[0] in ("sleep", "wake_up", "shutdown")] == [
        ("sleep", 1), ("wake_up", None), ("shutdown",)]
    # weights woken by an update while asleep: only the KV cache is still asleep
    be = FakeVLLMBackend(FakeVLLMBackend.Config(), context(tiny_qwen2))
    be.sleep(2)
    be.update_weights(_named(tiny_qwen2, 1.5), 1)
    be.shutdown()
    assert [c for c in be.fake.calls if c[0] in ("sleep", "wake_up", "shutdown")] == [
        ("sleep", 1), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",)), ("shutdown",)]
    assert not be.fake.asleep


def test_temperatures_vllm_refuses_error_before_the_engine(backend):
    async def main():
        return await asyncio.gather(gen(backend, [1, 2], max_tokens=3, temperature=2.5),
                                    gen(backend, [1, 2], max_tokens=3, temperature=2.0, ignore_eos=True),
                                    gen(backend, [1, 2], max_tokens=3, temperature=0.005, ignore_eos=True))

    hot, edge, cold = asyncio.run(main())
    assert hot.finish_reason == "error" and "[0, 2]" in hot.error
    assert edge.finish_reason == "length" and cold.finish_reason == "length"
    assert sum(c[0] == "add_request" for c in backend.fake.calls) == 2


def test_engine_step_failure_fails_requests_and_the_backend_recovers(backend):
    backend.fake.fail_next_step = True
    out = asyncio.run(gen(backend, [2, 3], max_tokens=5, ignore_eos=True))
    assert out.finish_reason == "error" and "device-side assert" in out.error
    again = asyncio.run(gen(backend, [2, 3], max_tokens=5, ignore_eos=True))
    assert again.finish_reason == "length" and len(again.token_ids) == 5


def test_invalid_requests_error_before_the_engine(backend):
    async def main():
        return await asyncio.gather(gen(backend, []), gen(backend, [1, 10**6]),
                                    gen(backend, [1] * (backend.max_model_len + 3)))

    for out in asyncio.run(main()):
        assert out.finish_reason == "error" and out.error
    assert not any(c[0] == "add_request" for c in backend.fake.calls)


def test_stats_count_tokens_and_requests(backend):
    asyncio.run(gen(backend, [1], max_tokens=4, ignore_eos=True))
    s = backend.stats()
    assert s["generated_tokens"] == 4 and s["requests"] == 1 and s["steps"] >= 4 and s["busy_s"] > 0
    assert backend.stats()["generated_tokens"] == 0  # reset on read


def test_shutdown_frees_the_engine_and_later_calls_fail_cleanly(tiny_qwen2):
    be = FakeVLLMBackend(FakeVLLMBackend.Config(), context(tiny_qwen2))
    fake = be.fake
    be.shutdown()
    be.shutdown()
    assert fake.calls[-1] == ("shutdown",)
    out = asyncio.run(gen(be, [1], max_tokens=2))
    assert out.finish_reason == "error" and "shut down" in out.error
    with pytest.raises(RuntimeError, match="shut down"):
        be.update_weights([], 1)


def test_the_real_backend_refuses_cpu_and_multi_rank(tiny_qwen2):
    from rlcli_vllm import VLLMBackend

    with pytest.raises(ValueError, match="runs on CUDA GPUs"):
        VLLMBackend(VLLMBackend.Config(), context(tiny_qwen2))
    ctx = context(tiny_qwen2)
    ctx.world_size = 2
    with pytest.raises(ValueError, match="single-rank"):
        VLLMBackend(VLLMBackend.Config(), ctx)


class _Allocation:
    def __init__(self, size, tag):
        self.handle, self.tag = (0, size, 0, None), tag


class _FakeCuMemAllocator:
    """vllm.device_allocator.cumem.CuMemAllocator as the plugin reads it (a process-wide singleton
    whose ``get_current_usage`` sums ``pointer_to_data``; vLLM asserts it is 0 before loading weights)."""

    instance = None

    def __init__(self):
        self.pointer_to_data = {}
        self.released = 0

    def get_current_usage(self):
        return sum(d.handle[1] for d in self.pointer_to_data.values())

    def release_pools(self):
        self.released += 1


@pytest.fixture
def fake_cumem(monkeypatch):
    import sys
    import types

    mod = types.ModuleType("vllm.device_allocator.cumem")
    mod.CuMemAllocator = _FakeCuMemAllocator
    _FakeCuMemAllocator.instance = _FakeCuMemAllocator()
    for name in ("vllm", "vllm.device_allocator"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", mod)
    yield _FakeCuMemAllocator.instance
    _FakeCuMemAllocator.instance = None


class _UsageRecordingBackend(FakeVLLMBackend):
    def _build_engine(self, api):
        self.usage_at_build = _FakeCuMemAllocator.instance.get_current_usage()  # what vLLM's assertion reads
        return super()._build_engine(api)


def test_a_new_engine_starts_beside_a_small_stale_allocation(fake_cumem, tiny_qwen2, caplog):
    fake_cumem.pointer_to_data[0x1000] = _Allocation(2 * 2**20, "weights")  # what vLLM 0.26 leaves after shutdown
    be = _UsageRecordingBackend(FakeVLLMBackend.Config(), context(tiny_qwen2))
    try:
        assert be.usage_at_build == 0  # the stale allocation is left out of vLLM's one-engine assertion...
        assert fake_cumem.get_current_usage() == 2 * 2**20  # ...only while the engine is built
        assert fake_cumem.released >= 1  # kept-alive pools were released first
        assert "2 MiB of an earlier, shut-down vLLM engine" in caplog.text and "weights: 1 allocation(s)" in caplog.text
        out = asyncio.run(gen(be, [5, 6], max_tokens=4, ignore_eos=True))
        assert len(out.token_ids) == 4
    finally:
        be.shutdown()


def test_a_new_engine_refuses_a_large_remainder_or_a_live_engine(fake_cumem, tiny_qwen2):
    fake_cumem.pointer_to_data[0x1000] = _Allocation(512 * 2**20, "kv_cache")
    with pytest.raises(RuntimeError, match=r"still holds 512 MiB .*kv_cache: 1 allocation\(s\), 512 MiB"):
        FakeVLLMBackend(FakeVLLMBackend.Config(), context(tiny_qwen2))
    fake_cumem.pointer_to_data.clear()
    first = FakeVLLMBackend(FakeVLLMBackend.Config(), context(tiny_qwen2))
    try:
        fake_cumem.pointer_to_data[0x2000] = _Allocation(2 * 2**20, "weights")  # the first engine's memory
        with pytest.raises(RuntimeError, match="another vLLM backend is running"):
            FakeVLLMBackend(FakeVLLMBackend.Config(), context(tiny_qwen2))
    finally:
        first.shutdown()


class _TableOnGpu:
    """A module-level table that vLLM's loader put on the GPU (is_cuda, and .cpu() gives it back)."""

    is_cuda = True

    def cpu(self):
        return torch.zeros(16)


def test_kernel_library_tables_leave_the_sleep_mode_pool(monkeypatch, tiny_qwen2):
    """flashinfer's FP4 table: imported before the engine is built (so it is made on the CPU), and moved
    to the CPU when an earlier engine had put it on the GPU."""
    import sys
    import types

    from rlcli_vllm import backend as backend_mod

    fp4 = types.ModuleType("fp4_tables")
    fp4._E2M1_VALUES = _TableOnGpu()
    monkeypatch.setitem(sys.modules, "fp4_tables", fp4)
    monkeypatch.setattr(backend_mod, "_IMPORT_TIME_TABLES", (("fp4_tables", "_E2M1_VALUES"), ("not_imported", "X")))
    backend_mod._drop_engine_globals()  # vLLM is not installed here: the other steps are skipped
    assert isinstance(fp4._E2M1_VALUES, torch.Tensor) and not fp4._E2M1_VALUES.is_cuda
    kept = fp4._E2M1_VALUES
    backend_mod._move_import_time_tables_to_cpu()
    assert fp4._E2M1_VALUES is kept  # a CPU table stays as it is

    imported = []
    monkeypatch.setattr(backend_mod, "_PREIMPORT", ("json", "no_such_kernel_library_xyz"))
    monkeypatch.setattr(backend_mod.importlib, "import_module",
                        lambda name, _real=backend_mod.importlib.import_module: imported.append(name) or _real(name))
    be = FakeVLLMBackend(FakeVLLMBackend.Config(), context(tiny_qwen2))  # a missing library is no error
    try:
        assert imported[:2] == ["json", "no_such_kernel_library_xyz"]  # before the engine is built
    finally:
        be.shutdown()


def test_auto_sizes_the_kv_cache_from_the_workload_and_a_share_goes_through(tiny_qwen2):
    workload = RolloutWorkload(max_sequences=40, max_sequence_tokens=37)

    def engine_kw(**options):
        be = FakeVLLMBackend(FakeVLLMBackend.Config(**options), replace(context(tiny_qwen2), workload=workload))
        be.shutdown()
        return be.engine_kw

    kw = engine_kw()
    # tiny qwen2: 2 layers x 2 KV heads x 16 dims, K and V, float32; 37 tokens = 3 blocks of 16;
    # +10 %, + vLLM's null block
    per_token = 2 * 2 * 16 * 2 * 4
    assert kw["kv_cache_memory_bytes"] == (120 + 12 + 1) * 16 * per_token
    assert kw["gpu_memory_utilization"] == 0.01  # no device here: only vLLM's start-up check reads it
    assert kw["max_num_seqs"] == 40  # the recipe's sequences in flight decode in one wave
    # max_batch_size bounds the sequences in flight; one max_model_len (512) sequence is the floor
    bounded = engine_kw(max_batch_size=8)
    assert bounded["kv_cache_memory_bytes"] == (33 + 4 + 1) * 16 * per_token and bounded["max_num_seqs"] == 8
    explicit = engine_kw(gpu_memory_utilization=0.3)
    assert explicit["gpu_memory_utilization"] == 0.3 and "kv_cache_memory_bytes" not in explicit
    assert explicit["max_num_seqs"] == 40  # the concurrency follows the recipe whatever sizes the cache
    big = FakeVLLMBackend(FakeVLLMBackend.Config(gpu_memory_utilization=0.3),
                          replace(context(tiny_qwen2), workload=RolloutWorkload(max_sequences=5000)))
    big.shutdown()
    assert big.engine_kw["max_num_seqs"] == 1024  # an eval set of thousands: capped (AUTO_MAX_BATCH)
