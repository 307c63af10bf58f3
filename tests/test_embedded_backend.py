"""The embedded continuous-batching engine: sampling, control, models and plugin wiring; the home of the
shared fixtures and helpers. Scheduling: test_embedded_scheduling.py."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from rlcli.backends.base import BackendContext, GenerateOutput, GenerateRequest
from rlcli.backends.embedded import (
    SUPPORTED_MODEL_TYPES,
    EmbeddedBackend,
    LlamaFamilyModel,
    counter_uniform,
    filter_top_k_top_p,
    sample_plain,
    sample_plain_keyed,
    seed_keys,
)
from rlcli.testing.backend_conformance import default_context, make_tiny_model_dirs, reference_logprobs
from rlcli.types import SampleParams


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return make_tiny_model_dirs(tmp_path_factory.mktemp("embedded"), arch="llama", seed=3)


@pytest.fixture(scope="module")
def model_dir(model_dirs):
    return model_dirs[0]


def make(model_dir, **config) -> EmbeddedBackend:
    return EmbeddedBackend(EmbeddedBackend.Config(**config), default_context(model_dir))


def req(prompt, seed=None, **params) -> GenerateRequest:
    return GenerateRequest(list(prompt), SampleParams(**params), seed=seed)


async def gather(backend, requests) -> list[GenerateOutput]:
    return await asyncio.gather(*(backend.generate(r) for r in requests))


def run_all(backend, requests) -> list[GenerateOutput]:
    return asyncio.run(gather(backend, requests))


def prompts(n, rng, lo=1, hi=10, vocab=53):
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# ------------------------------------------------------------------------------------------ sampling
def test_top_k_1_and_tiny_top_p_equal_greedy(model_dir):
    be = make(model_dir, max_batch_size=64)
    ps = prompts(6, random.Random(0))
    greedy = run_all(be, [req(p, temperature=0.0, max_tokens=12, ignore_eos=True) for p in ps])
    kw = dict(max_tokens=12, ignore_eos=True)
    top_k = run_all(be, [req(p, seed=i, temperature=1.3, top_k=1, **kw) for i, p in enumerate(ps)])
    top_p = run_all(be, [req(p, seed=i, temperature=0.9, top_p=1e-6, **kw) for i, p in enumerate(ps)])
    for g, k, p in zip(greedy, top_k, top_p):
        assert k.token_ids == g.token_ids
        assert p.token_ids == g.token_ids
    # the logprob is under the temperature, not renormalised over the single kept token
    for prompt, g, k in zip(ps, greedy, top_k):
        want = reference_logprobs(model_dir, prompt, k.token_ids, 1.3)
        want = want.gather(1, torch.tensor(k.token_ids)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(k.logprobs), want, atol=1e-4)
        assert max(k.logprobs) < 0.0
    be.shutdown()


def test_first_token_distribution_matches_softmax(model_dir):
    """2000 seeded draws of the first token follow softmax(logits / T), restricted by top-k/top-p."""
    be = make(model_dir, max_batch_size=512)
    prompt = [5, 17, 23, 9]
    n = 2000
    for temp, top_k, top_p in ((1.0, 0, 1.0), (0.7, 4, 1.0), (1.0, 0, 0.6)):
        kw = dict(temperature=temp, top_k=top_k, top_p=top_p, max_tokens=1)
        outs = run_all(be, [req(prompt, seed=s, **kw) for s in range(n)])
        counts = Counter(o.token_ids[0] for o in outs)
        lp = reference_logprobs(model_dir, prompt, [0], temp)[0]
        probs = lp.exp()
        order = probs.argsort(descending=True)
        keep = torch.ones_like(probs, dtype=torch.bool)
        if top_k:
            keep[:] = False
            keep[order[:top_k]] = True
        if top_p < 1.0:
            cum = torch.cumsum(probs[order], 0)
            before = torch.cat([torch.zeros(1), cum[:-1]])
            keep[:] = False
            keep[order[before < top_p]] = True
        target = torch.where(keep, probs, torch.zeros_like(probs))
        target /= target.sum()
        assert set(counts) <= set(torch.nonzero(keep).flatten().tolist()), "sampled a token outside the kept set"
        empirical = torch.zeros_like(probs)
        for t, c in counts.items():
            empirical[t] = c / n
        tv = 0.5 * (empirical - target).abs().sum().item()
        assert tv < 0.06, f"T={temp} top_k={top_k} top_p={top_p}: total variation {tv:.3f}"
        # logprobs are those of the unfiltered tempered distribution
        for o in outs[:20]:
            assert o.logprobs[0] == pytest.approx(lp[o.token_ids[0]].item(), abs=1e-4)
    be.shutdown()


def test_filter_top_k_top_p_keeps_ties_and_prefix():
    scores = torch.tensor([[3.0, 1.0, 3.0, 0.5, -1.0], [0.0, 0.0, 0.0, 0.0, 10.0]])
    out = filter_top_k_top_p(scores, torch.tensor([1, 0]), torch.tensor([1.0, 1.0]), use_top_p=False, max_top_k=1)
    assert torch.isfinite(out[0]).tolist() == [True, False, True, False, False]  # tie at the cut is kept
    assert torch.isfinite(out[1]).all()  # top_k=0 is off
    out = filter_top_k_top_p(scores, torch.tensor([0, 0]), torch.tensor([0.5, 0.9]), use_top_p=True, max_top_k=0)
    assert torch.isfinite(out[0]).tolist() == [True, False, True, False, False]
    assert torch.isfinite(out[1]).tolist() == [False, False, False, False, True]


def test_counter_uniform_is_a_pure_function_of_seed_and_position():
    k1, k2 = zip(*(seed_keys(s) for s in range(4096)))
    k1, k2 = torch.tensor(k1), torch.tensor(k2)
    pos = torch.arange(4096) % 37
    u = counter_uniform(k1, k2, pos)
    assert u.dtype == torch.float32 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.02 and abs(float(u.var()) - 1 / 12) < 0.01
    # elementwise: computing a subset (another "batch") gives the same numbers
    assert torch.equal(counter_uniform(k1[100:110], k2[100:110], pos[100:110]), u[100:110])
    # consecutive positions of one seed are decorrelated
    one = counter_uniform(k1[:1].expand(4096), k2[:1].expand(4096), torch.arange(4096))
    assert abs(float(torch.corrcoef(torch.stack([one[:-1], one[1:]]))[0, 1])) < 0.05
    assert len(set(one.tolist())) > 4000


# ------------------------------------------------------------------------------------------ control
def test_pause_with_many_requests_in_flight(model_dir):
    be = make(model_dir, max_batch_size=64)
    rng = random.Random(5)
    requests = [req(p, temperature=1.0, max_tokens=400, ignore_eos=True) for p in prompts(150, rng, 2, 8)]

    async def main():
        tasks = [asyncio.ensure_future(be.generate(r)) for r in requests]
        while be.engine.num_active == 0 or be.stats()["generated_tokens"] == 0:
            await asyncio.sleep(0.005)
        be.pause()
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        late = await be.generate(requests[0])
        be.resume()
        fresh = await be.generate(req([5, 6], max_tokens=3, ignore_eos=True))
        return outs, late, fresh

    outs, late, fresh = asyncio.run(main())
    assert all(o.finish_reason == "abort" for o in outs)
    assert sum(1 for o in outs if o.token_ids) >= 1
    assert sum(1 for o in outs if not o.token_ids) >= 1  # some never got a row (64 rows, 150 requests)
    for o in outs:
        assert len(o.token_ids) == len(o.logprobs) == len(o.versions) < 400
    assert late.finish_reason == "abort" and not late.token_ids
    assert fresh.finish_reason == "length" and len(fresh.token_ids) == 3
    assert be.engine.num_active == 0
    be.shutdown()


def test_cancelled_request_releases_its_row(model_dir):
    be = make(model_dir, max_batch_size=4)

    async def main():
        long = asyncio.ensure_future(be.generate(req([5, 6], max_tokens=400, ignore_eos=True)))
        short = asyncio.ensure_future(be.generate(req([7, 8], max_tokens=20, ignore_eos=True)))
        while be.engine.num_active < 2:
            await asyncio.sleep(0.002)
        long.cancel()
        out = await short
        with pytest.raises(asyncio.CancelledError):
            await long
        for _ in range(200):
            if not be.engine.has_work():
                break
            await asyncio.sleep(0.005)
        return out

    out = asyncio.run(main())
    assert len(out.token_ids) == 20
    assert be.engine.num_active == 0 and not be.engine.has_work()
    be.shutdown()


def test_update_weights_validation_and_tied_lm_head(model_dirs):
    a, b = model_dirs
    be = make(a, max_batch_size=4)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.nope.*also\.unknown"):
        be.update_weights([("model.layers.0.nope", torch.zeros(2)), ("also.unknown", torch.zeros(2))], 5)
    with pytest.raises(ValueError, match="shape mismatch"):
        be.update_weights([("model.norm.weight", torch.zeros(3))], 5)
    assert be.version == 0
    embed = be.engine.model.embed.weight
    new = torch.randn_like(embed).to(torch.bfloat16)  # cast to the engine dtype on copy
    be.update_weights([("lm_head.weight", new)], 3)  # tied: the shared embedding changes
    assert torch.equal(embed, new.float()) and be.engine.model.lm_head.weight is embed
    assert be.version == 3
    out = run_all(be, [req([5, 6], max_tokens=4, ignore_eos=True)])[0]
    assert out.versions == [3, 3, 3, 3]
    be.shutdown()


def test_sleep_holds_requests_until_wake_up(model_dir):
    be = make(model_dir, max_batch_size=4)
    want = run_all(be, [req([5, 6, 7], temperature=0.0, max_tokens=6)])[0]

    async def main():
        be.sleep(2)
        assert not be.engine.cache.allocated
        task = asyncio.ensure_future(be.generate(req([5, 6, 7], temperature=0.0, max_tokens=6)))
        await asyncio.sleep(0.05)
        assert not task.done()
        be.wake_up()
        return await asyncio.wait_for(task, 10)

    got = asyncio.run(main())
    assert got.token_ids == want.token_ids
    with pytest.raises(ValueError):
        be.sleep(3)
    be.shutdown()


def test_sleep_1_keeps_decode_graphs_only_while_the_cache_returns_to_its_address(model_dir, monkeypatch):
    """CUDA graphs bake the KV cache's address in: sleep(1) + wake_up keeps them when the cache
    comes back at the same address, drops them when it does not; sleep(2) (the weights move) and a
    second sleep always drop them. The cache is one buffer, every layer's keys and values views of it."""
    be = make(model_dir, max_batch_size=4)
    cache = be.engine.cache
    assert all(t.untyped_storage().data_ptr() == cache.address for t in cache.k + cache.v)
    resets = []

    class Graphs:  # records resets (no CUDA here)
        def reset(self):
            resets.append(1)

    be.engine.cuda_graphs = Graphs()
    be.keeps_cache_asleep = False  # as on a GPU
    be.sleep(1)
    assert cache.address is None
    be.wake_up()
    addresses = iter([111, 222])  # where the cache was, then where it comes back
    monkeypatch.setattr(type(cache), "address", property(lambda self: None if self._buffer is None else next(addresses)))
    resets.clear()
    be.sleep(1)  # records 111
    be.wake_up()  # comes back at 222: stale graphs dropped
    assert resets == [1]
    monkeypatch.setattr(type(cache), "address", property(lambda self: None if self._buffer is None else 7))
    resets.clear()
    be.sleep(1)
    be.wake_up()  # same address: kept
    assert resets == []
    be.sleep(1)
    be.sleep(1)  # asleep already: nothing to compare against, dropped at wake
    be.wake_up()
    assert resets == [1]
    resets.clear()
    be.sleep(2)
    assert resets == [1]
    be.wake_up()
    resets.clear()
    be.wake_up()  # awake already: nothing happens
    assert resets == []
    be.engine.cuda_graphs = None
    # and it still generates after all that
    out = run_all(be, [req([5, 6, 7], temperature=0.0, max_tokens=4)])[0]
    assert len(out.token_ids) == 4
    be.shutdown()


def test_kv_cache_is_always_finite(model_dir):
    # masked attention still multiplies unwritten positions by 0, so they must never hold NaN
    be = make(model_dir, max_batch_size=8)
    cache = be.engine.cache
    assert all(torch.count_nonzero(t) == 0 for t in cache.k + cache.v)
    be.sleep(2)
    assert not cache.allocated
    be.wake_up()
    assert all(torch.count_nonzero(t) == 0 for t in cache.k + cache.v)
    be.sleep(1)  # on the CPU level 1 keeps the cache (host memory either way): nothing to allocate again
    assert cache.allocated
    be.wake_up()
    outs = run_all(be, [req(list(range(4, 4 + n)), seed=n, max_tokens=3 * n, ignore_eos=True) for n in (1, 5, 9, 13)])
    assert all(len(o.token_ids) == len(o.logprobs) and all(lp > -1e4 for lp in o.logprobs) for o in outs)
    be.shutdown()


def test_decode_writes_logits_into_a_given_buffer(model_dir):
    # CUDA graphs hand decode their static logits buffer: the output projection writes it directly
    be = make(model_dir, max_batch_size=4)
    model, cache = be.engine.model, be.engine.cache
    tokens, positions = torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2])
    with torch.inference_mode():  # as the engine runs (the KV cache is an inference tensor)
        want = model.decode(tokens, positions, cache, 4)
        buf = torch.full((4, want.shape[1]), float("nan"), dtype=want.dtype)
        got = model.decode(tokens, positions, cache, 4, out=buf[:3])
    assert got.data_ptr() == buf.data_ptr() and torch.equal(buf[:3], want) and buf[3].isnan().all()
    be.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_fused_projections_decode_like_the_separate_ones_and_take_updates(tmp_path, arch):
    d = make_tiny_model_dirs(tmp_path, arch=arch, seed=4)[0]
    be = make(d, max_batch_size=4)
    model, cache = be.engine.model, be.engine.cache
    layer = model.layers[1]
    assert layer.qkv_weight is not None and layer.gate_up_weight is not None
    assert (layer.qkv_bias is not None) == (arch == "qwen2")
    assert layer.k_proj.weight.data_ptr() == layer.qkv_weight[layer.q_proj.out_features:].data_ptr()
    tokens, positions = torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2])
    with torch.inference_mode():  # as the engine runs
        fused = model.decode(tokens, positions, cache, 4)
        saved = [(ly.qkv_weight, ly.qkv_bias, ly.gate_up_weight) for ly in model.layers]
        for ly in model.layers:  # the Hugging Face modules alone
            ly.qkv_weight = ly.qkv_bias = ly.gate_up_weight = None
        cache.free()
        cache.allocate()
        assert torch.allclose(model.decode(tokens, positions, cache, 4), fused, atol=1e-5)
    for ly, (w, b, gu) in zip(model.layers, saved):
        ly.qkv_weight, ly.qkv_bias, ly.gate_up_weight = w, b, gu
    # an in-place update of one projection lands in the fused matrix
    name = "model.layers.1.mlp.up_proj.weight"
    new = torch.randn_like(layer.mlp.up_proj.weight)
    be.update_weights([(name, new)], version=1)
    assert torch.equal(layer.gate_up_weight[layer.mlp.gate_proj.out_features:], new)
    # sleep(2) on a GPU parks the weights on the CPU: the fused matrices go with the device memory
    model.hf.to(torch.float64)
    model.to("cpu")
    assert all(ly.qkv_weight is None and ly.gate_up_weight is None for ly in model.layers)
    # wake_up moves them back, which replaced the views by copies: the model re-fuses (what
    # model.to(device) does for a non-CPU device)
    model.fuse_projections()
    assert layer.qkv_weight.dtype == torch.float64
    assert layer.v_proj.weight.data_ptr() == layer.qkv_weight[-layer.v_proj.out_features:].data_ptr()
    be.shutdown()


def test_bfloat16_kv_cache_runs(model_dir):
    be = make(model_dir, max_batch_size=8, kv_cache_dtype="bfloat16")
    assert be.engine.cache.dtype == torch.bfloat16
    outs = run_all(be, [req([5, 6, 7], seed=s, max_tokens=10, ignore_eos=True) for s in range(4)])
    assert all(len(o.token_ids) == 10 and all(lp <= 0 for lp in o.logprobs) for o in outs)
    be.shutdown()


# ------------------------------------------------------------------------------------------ models
def test_unsupported_model_type_is_a_clear_error():
    fake = SimpleNamespace(config=SimpleNamespace(model_type="gpt2"))
    with pytest.raises(ValueError) as info:
        LlamaFamilyModel(fake)
    for name in SUPPORTED_MODEL_TYPES:
        assert name in str(info.value)
    assert "gpt2" in str(info.value)


def test_mistral_sliding_window_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, GenerationConfig, MistralConfig

    cfg = MistralConfig(
        vocab_size=53, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, sliding_window=6, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 3.0 / p.shape[1] ** 0.5)
    ref.save_pretrained(tmp_path)
    ref.generation_config = GenerationConfig()
    ctx = BackendContext(str(tmp_path), torch.device("cpu"), torch.float32, eos_token_ids=[1], pad_token_id=0)
    be = EmbeddedBackend(EmbeddedBackend.Config(max_batch_size=4), ctx)
    assert [layer.window for layer in be.engine.model.layers] == [6, 6]
    prompt = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41]  # longer than the window
    out = run_all(be, [req(prompt, temperature=0.0, max_tokens=12, ignore_eos=True)])[0]
    ids = torch.tensor([prompt])
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12, pad_token_id=0)
    assert out.token_ids == want[0, len(prompt) :].tolist()
    be.shutdown()


# ------------------------------------------------------------------------------------------ component
def test_config_fields_are_documented_and_strict():
    for name, f in EmbeddedBackend.Config.model_fields.items():
        assert f.description, f"Config.{name} has no description"
    with pytest.raises(Exception):
        EmbeddedBackend.Config(max_batch_sizes=3)
    assert EmbeddedBackend.Config().max_batch_size == 256


def test_registered_through_the_plugin_registry():
    from rlcli.plugins import get_registry, registry_with

    assert get_registry().get("inference_backend", "embedded") is EmbeddedBackend
    assert registry_with().get("inference_backend", "embedded") is EmbeddedBackend


def _plain_and_mixed(backend, n=10):
    """Outputs of a batch of plain sampling requests (the fused sampler), then of a batch mixing
    greedy, top-p and plain rows (the general path)."""
    rng = random.Random(21)
    ps = prompts(n, rng)
    plain = [req(p, seed=i, max_tokens=12, temperature=0.8) for i, p in enumerate(ps)]
    mixed = [req(p, seed=i, max_tokens=12, temperature=0.0 if i % 3 == 0 else 1.0, top_p=0.9 if i % 2 else 1.0)
             for i, p in enumerate(ps)]
    return run_all(backend, plain) + run_all(backend, mixed)


def test_compiled_decode_and_sampler_match_eager(model_dir):
    """`compile: true` (the CUDA default) runs the decoder layers and the sampler through
    torch.compile (here its CPU backend): same tokens, same logprobs as eager PyTorch."""
    eager = _plain_and_mixed(make(model_dir, compile=False))
    be = make(model_dir, compile=True)
    got = _plain_and_mixed(be)
    assert be._model._layer_fn != be._model._decode_layer  # still compiled: no fallback happened
    assert be.engine._sample_plain is not sample_plain_keyed
    for a, b in zip(eager, got):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_sleep_and_wake_do_not_recompile_the_decoder(model_dir):
    # The compiled layers guard on the kind of tensor the KV cache is; a cache re-allocated as a
    # different kind after wake_up recompiled them in the first rollout after every sync (~3 s on the H200).
    from torch._dynamo.utils import counters

    be = make(model_dir, compile=True, max_batch_size=8)
    requests = lambda: [req([5, 6, 7], seed=s, max_tokens=6, ignore_eos=True) for s in range(4)]  # noqa: E731
    first = run_all(be, requests())
    frames = counters["frames"]["total"]
    be.sleep(1)
    be.wake_up()
    assert [o.token_ids for o in run_all(be, requests())] == [o.token_ids for o in first]
    assert counters["frames"]["total"] == frames
    be.shutdown()


def test_compiled_decode_serves_new_batch_sizes_and_lengths_without_recompiling(model_dir):
    # the row count and the key length are marked symbolic (everything else stays a constant, see
    # rlcli.compiling, whose own test checks that); once warm, other batch sizes and lengths
    # compile nothing new
    from torch._dynamo.utils import counters

    be = make(model_dir, compile=True, max_batch_size=8)
    run_all(be, [req([5, 6, 7] * (s + 1), seed=s, max_tokens=9 + s, ignore_eos=True) for s in range(6)])
    frames = counters["frames"]["total"]
    outs = run_all(be, [req([9, 8, 7, 6, 5][: 2 + s], seed=s, max_tokens=20, ignore_eos=True) for s in range(3)])
    assert all(len(o.token_ids) == 20 for o in outs)
    assert counters["frames"]["total"] == frames
    be.shutdown()


def test_failed_compilation_falls_back_to_eager(model_dir, monkeypatch, caplog):
    def broken_compile(fn, **kw):
        def run(*args, **kwargs):
            raise RuntimeError("no compiler here")
        return run

    eager = _plain_and_mixed(make(model_dir, compile=False))
    monkeypatch.setattr(torch, "compile", broken_compile)
    be = make(model_dir, compile=True)
    with caplog.at_level("WARNING"):
        got = _plain_and_mixed(be)
    assert [o.token_ids for o in got] == [o.token_ids for o in eager]
    assert be._model._layer_fn == be._model._decode_layer
    assert be.engine._sample_plain is sample_plain_keyed
    assert "decoding eagerly" in caplog.text and "sampling eagerly" in caplog.text


@pytest.mark.parametrize("temperature", [None, 0.7])
def test_sample_plain_is_the_inverse_cdf_draw_with_exact_logprobs(temperature):
    """The fused plain sampler draws the same token as the general path's inverse CDF and returns
    the token's log-softmax under the temperature-scaled logits."""
    from rlcli.backends.embedded import sample_tokens

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 997, generator=g) * 3
    u = torch.rand(64, generator=g) * (1 - 2**-20)
    temp = None if temperature is None else torch.full((64,), temperature)
    tok, lp = sample_plain(logits.bfloat16(), temp, u)
    scaled = logits.bfloat16().float() / (temperature or 1.0)
    assert torch.equal(tok, sample_tokens(scaled, u))
    ref = torch.log_softmax(scaled, dim=-1).gather(1, tok[:, None]).squeeze(1)
    assert torch.allclose(lp, ref, atol=1e-5)


@pytest.mark.parametrize("vocab", [151_936, 997, 8])
def test_two_level_inverse_cdf_matches_the_exact_draw_and_never_picks_a_masked_token(vocab):
    """The sampler's two-level CDF (block sums, then one block) draws the token a float64 inverse
    CDF draws, bar rounding at a boundary, for a vocabulary split evenly into blocks, one padded
    (997, prime) and one smaller than a block; masked (-inf) tokens are never chosen."""
    from rlcli.backends.embedded import sample_tokens

    g = torch.Generator().manual_seed(3)
    scores = torch.randn(128, vocab, generator=g) * 3
    scores[:, 1::3] = float("-inf")
    u = torch.randint(0, 2**23, (128,), generator=g).float() * 2**-23
    u[:3] = torch.tensor([0.0, 0.5, 1 - 2**-23])
    tok = sample_tokens(scores, u)
    assert torch.isfinite(scores.gather(1, tok[:, None])).all()
    x = scores.double()
    cum = (x - x.amax(dim=-1, keepdim=True)).exp().cumsum(dim=-1)
    exact = torch.searchsorted(cum, (u.double() * cum[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    assert (tok == exact).float().mean() >= 0.98
    # frequencies follow the distribution
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    draws = sample_tokens(probs.log().repeat(100_000, 1), torch.rand(100_000, generator=g) * (1 - 2**-23))
    assert torch.allclose(torch.bincount(draws, minlength=4) / 100_000, probs, atol=0.01)


def test_tied_weights_sent_under_both_names_are_copied_once(model_dirs, monkeypatch):
    be = make(model_dirs[0])
    embed = be.engine.model.embed.weight
    assert be.engine.model.lm_head.weight is embed  # a tied model
    new = torch.randn_like(embed)
    copies = []
    real_copy = torch.Tensor.copy_

    def counting_copy(self, src, *a, **kw):
        copies.append(self.data_ptr())
        return real_copy(self, src, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)
    n = be.engine.model.load_named_tensors([("model.embed_tokens.weight", new), ("lm_head.weight", new)])
    monkeypatch.undo()
    assert n == 2 and copies.count(embed.data_ptr()) == 1
    assert torch.equal(embed, new)
    be.shutdown()


def test_fewer_slots_than_training_sequences_in_flight_is_warned(model_dir, caplog):
    """An async recipe over-samples: with fewer decode slots than sequences in flight, the rest queue."""
    from dataclasses import replace

    from rlcli.backends.base import RolloutWorkload

    def build(max_batch_size, workload):
        ctx = replace(default_context(model_dir), workload=workload)
        caplog.clear()
        with caplog.at_level("WARNING"):
            EmbeddedBackend(EmbeddedBackend.Config(max_batch_size=max_batch_size), ctx)
        return caplog.text

    text = build(8, RolloutWorkload(max_sequences=24, max_sequence_tokens=16, train_sequences=24))
    assert "rollout.max_batch_size=8 is below the 24 training sequences" in text and "max_batch_size: 24" in text
    assert build(24, RolloutWorkload(24, 16, 24)) == ""
    assert build(8, RolloutWorkload(500, 16, 0)) == ""  # an eval set queues by design: no warning


def test_logprobs_only_for_the_requests_that_ask(model_dir):
    be = make(model_dir)
    both = run_all(be, [req([5, 6, 7], seed=1, max_tokens=4, ignore_eos=True),
                        req([5, 6, 7], seed=1, max_tokens=4, ignore_eos=True, return_logprob=False)])
    asked, not_asked = both
    assert asked.token_ids == not_asked.token_ids and len(asked.logprobs) == 4 and not_asked.logprobs == []
    alone = run_all(be, [req([8, 9], max_tokens=3, ignore_eos=True, return_logprob=False)])[0]
    assert len(alone.token_ids) == 3 and alone.logprobs == [] and len(alone.versions) == 3
