"""The backend conformance kit, run against the embedded engine on CPU (llama, qwen2, qwen3)."""

from __future__ import annotations

import re

import pytest
import torch

from rlcli.backends.embedded import EmbeddedBackend
from rlcli.testing import backend_conformance as bc

ARCHS = ["llama", "qwen2", "qwen3"]


def make_backend(model_dir):
    return EmbeddedBackend(EmbeddedBackend.Config(max_batch_size=64), bc.default_context(model_dir))


@pytest.fixture(scope="module", params=ARCHS)
def dirs(request, tmp_path_factory):
    return bc.make_tiny_model_dirs(tmp_path_factory.mktemp(request.param), arch=request.param)


@pytest.mark.parametrize("name", [n for n in bc.ALL_CHECKS if n != "weight_update"])
def test_check(dirs, name):
    bc.ALL_CHECKS[name](make_backend, dirs[0])


def test_weight_update(dirs):
    bc.check_weight_update(make_backend, dirs[0], dirs[1])


@pytest.fixture(scope="module")
def qwen2_dirs(tmp_path_factory):
    return bc.make_tiny_model_dirs(tmp_path_factory.mktemp("overlap"), arch="qwen2", seed=17)


@pytest.mark.parametrize("name", ["stop_and_length", "min_tokens", "pause_returns_partial_and_continue",
                                  "many_concurrent"])
def test_overlapped_decode_passes_the_kit(qwen2_dirs, name):
    """The engine's overlapped decode (on by default on CUDA only) forced on: the kit's checks of
    stops, lengths, min_tokens, pause/continue and many concurrent requests still pass."""
    def make_overlapped(model_dir):
        be = make_backend(model_dir)
        be.engine.overlap = True
        return be

    bc.ALL_CHECKS[name](make_overlapped, qwen2_dirs[0])


def test_run_all_runs_every_check(tmp_path):
    a, b = bc.make_tiny_model_dirs(tmp_path, arch="llama", seed=11)
    options = {"greedy_matches_reference": {"max_tokens": 8}}
    ran = bc.run_all(make_backend, a, b, skip=["many_concurrent"], options=options)
    assert ran == [n for n in bc.ALL_CHECKS if n != "many_concurrent"]
    with pytest.raises(ValueError, match="no_such_check"):
        bc.run_all(make_backend, a, b, skip=["no_such_check"])


def test_kit_reports_a_broken_backend(tmp_path):
    """The kit fails, naming the check, on a backend that renormalises logprobs after top-k."""
    a, b = bc.make_tiny_model_dirs(tmp_path, arch="qwen2", seed=12)

    class Renormalising(EmbeddedBackend):
        async def generate(self, request):
            out = await super().generate(request)
            out.logprobs = [0.0 for _ in out.logprobs]  # as if renormalised over a single token
            return out

    def make_broken(model_dir):
        return Renormalising(EmbeddedBackend.Config(max_batch_size=16), bc.default_context(model_dir))

    with pytest.raises(AssertionError, match=r"\[logprobs_match_forward\]") as err:
        bc.run_all(make_broken, a, b, skip=["greedy_matches_reference"])
    # the message locates the worst token, for diagnosis
    assert re.search(r"largest at position \d+ of 16 \(token \d+: engine 0, forward -[\d.]+\); mean difference",
                     str(err.value)), str(err.value)


def test_logprob_check_bounds_the_mean_difference_too(tmp_path):
    """``mean_atol``: a small bias on every token passes a loose ``atol`` but not a tight mean."""
    a, _ = bc.make_tiny_model_dirs(tmp_path, arch="qwen2", seed=15)

    class Biased(EmbeddedBackend):
        async def generate(self, request):
            out = await super().generate(request)
            out.logprobs = [lp - 0.05 for lp in out.logprobs]
            return out

    def make_biased(model_dir):
        return Biased(EmbeddedBackend.Config(max_batch_size=16), bc.default_context(model_dir))

    settings = [dict(temperature=1.0)]
    bc.check_logprobs_match_forward(make_biased, a, settings=settings, atol=0.1, max_tokens=6)
    with pytest.raises(AssertionError, match=r"by 0.05 on average \(mean_atol 0.01\)"):
        bc.check_logprobs_match_forward(make_biased, a, settings=settings, atol=0.1, mean_atol=0.01, max_tokens=6)


def test_greedy_check_allows_a_near_tie_only_within_argmax_atol(tmp_path):
    """A greedy token that is not the float32 argmax fails, naming the gap, unless within ``argmax_atol``
    (bf16 engines: two near-tied logits can swap order)."""
    a, _ = bc.make_tiny_model_dirs(tmp_path, arch="qwen2", seed=16)

    class RunnerUp(EmbeddedBackend):
        """Greedy requests answer the runner-up token first, with exact logprobs."""

        async def generate(self, request):
            out = await super().generate(request)
            if request.params.temperature == 0.0:
                first = bc.reference_logprobs(a, request.prompt_ids, out.token_ids[:1], 1.0)[0]
                out.token_ids = [int(first.topk(2).indices[1])] + list(out.token_ids[1:])
                ref = bc.reference_logprobs(a, request.prompt_ids, out.token_ids, 1.0)
                out.logprobs = ref.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1).tolist()
            return out

    def make(model_dir):
        return RunnerUp(EmbeddedBackend.Config(max_batch_size=16), bc.default_context(model_dir))

    settings = [dict(temperature=0.0)]
    with pytest.raises(AssertionError, match=r"greedy token \d+ at position \d+ is not the argmax: its reference "
                                             r"logprob is [\d.]+ below the largest \(argmax_atol 1e-05\)"):
        bc.check_logprobs_match_forward(make, a, settings=settings, max_tokens=4)
    bc.check_logprobs_match_forward(make, a, settings=settings, max_tokens=4, argmax_atol=100.0)


def test_many_concurrent_compares_greedy_copies_unless_told_not_to(tmp_path):
    """Greedy copies that part (as a batch-dependent engine's can) fail the check by default,
    naming the prompt; ``copies_agree=False`` accepts them and still checks the rest."""
    a, _ = bc.make_tiny_model_dirs(tmp_path, arch="qwen2", seed=18)
    seen: dict[tuple, int] = {}

    class Parting(EmbeddedBackend):
        """The second greedy answer to each prompt ends with a different (non-stop) token."""

        async def generate(self, request):
            out = await super().generate(request)
            if request.params.temperature == 0.0 and out.finish_reason == "length":
                key = tuple(request.prompt_ids)
                seen[key] = seen.get(key, 0) + 1
                if seen[key] == 2:
                    stops = set(self.ctx.eos_token_ids or [])
                    out.token_ids = list(out.token_ids[:-1]) + [
                        next(t for t in range(3, 60) if t != out.token_ids[-1] and t not in stops)]
            return out

    def make(model_dir):
        return Parting(EmbeddedBackend.Config(max_batch_size=64), bc.default_context(model_dir))

    small = dict(n_prompts=8, repeat=3, max_tokens=6, batch_invariant=False)
    with pytest.raises(AssertionError, match=r"greedy copies of \[[\d, ]+\] differ"):
        bc.check_many_concurrent(make, a, **small)
    seen.clear()
    bc.check_many_concurrent(make, a, **small, copies_agree=False)
    assert any(n >= 2 for n in seen.values())  # parting answers were made
    with pytest.raises(ValueError, match="copies_agree"):
        bc.check_many_concurrent(make, a, batch_invariant=True, copies_agree=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sleep_wake_releases_cuda_memory(tmp_path):
    a, _ = bc.make_tiny_model_dirs(tmp_path, arch="qwen2", seed=13)

    def make_cuda(model_dir):
        ctx = bc.default_context(model_dir, device="cuda", dtype=torch.float32)
        return EmbeddedBackend(EmbeddedBackend.Config(max_batch_size=64), ctx)

    bc.check_sleep_wake(make_cuda, a, min_release_fraction=0.9)
    bc.check_greedy_matches_reference(make_cuda, a)
    bc.check_logprobs_match_forward(make_cuda, a, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_decode_graphs_survive_sleep_1_when_the_cache_returns(tmp_path):
    """sleep(1)/wake_up() with nothing allocated in between: the KV cache comes back at its address,
    the captured decode graphs are kept (not re-captured), and greedy outputs are unchanged."""
    import asyncio

    from rlcli.backends.base import GenerateRequest
    from rlcli.types import SampleParams

    a, _ = bc.make_tiny_model_dirs(tmp_path, arch="qwen2", seed=13)
    be = EmbeddedBackend(EmbeddedBackend.Config(max_batch_size=16),
                         bc.default_context(a, device="cuda", dtype=torch.float32))

    def greedy():
        reqs = [GenerateRequest(prompt_ids=[3 + i, 5, 7], params=SampleParams(temperature=0.0, max_tokens=12,
                                                                              ignore_eos=True)) for i in range(6)]

        async def run():
            return await asyncio.wait_for(asyncio.gather(*map(be.generate, reqs)), 120)

        return [o.token_ids for o in asyncio.run(run())]

    try:
        before = greedy()
        graphs = be.engine.cuda_graphs.num_graphs
        assert graphs > 0 and be.stats()["cuda_graph_captures"] == graphs
        address = be.engine.cache.address
        be.sleep(1)
        be.wake_up()
        assert be.engine.cache.address == address
        assert be.engine.cuda_graphs.num_graphs == graphs  # kept
        assert greedy() == before
        assert be.engine.cuda_graphs.num_graphs == graphs  # replayed, none captured
        assert be.stats()["cuda_graph_captures"] == 0
    finally:
        be.shutdown()


def test_reusing_backends_builds_few_and_isolates_failures(tmp_path):
    """reuse=True: consecutive checks share one backend (4 builds for the 10 checks: the model,
    the other model and the model again in weight_update, and sleep_wake's own), at most one is
    alive at a time, every one is shut down at the end, and a failing check's backend is not
    handed to the next check."""
    a, b = bc.make_tiny_model_dirs(tmp_path, arch="llama", seed=13)
    built, alive = [], set()

    class Tracked(EmbeddedBackend):
        def shutdown(self):
            alive.discard(id(self))
            super().shutdown()

    def make(model_dir):
        be = Tracked(EmbeddedBackend.Config(max_batch_size=64), bc.default_context(model_dir))
        assert not alive, "a second backend was built while another was alive"
        built.append(be)
        alive.add(id(be))
        return be

    with bc.reusing_backends() as shared:
        ran = bc.run_all(make, a, b, options={"greedy_matches_reference": {"max_tokens": 8}})
        assert len(ran) == len(bc.ALL_CHECKS)
    assert shared.built == len(built) == 4
    assert not alive

    # a failing check: its backend is shut down, the next check gets a new one
    built.clear()
    with bc.reusing_backends():
        with pytest.raises(AssertionError):
            bc.check_greedy_matches_reference(make, a, prompts=[[5, 6]], max_tokens=4, min_exact_fraction=2.0)
        assert not alive
        bc.check_stop_and_length(make, a)
        assert len(built) == 2 and alive == {id(built[1])}
    assert not alive


def test_logprob_check_with_explicit_settings(tmp_path):
    """``settings`` sends every prompt with each given sampling setting (the engine plugins' way of
    checking only the range where their logprobs are exact); a wrong logprob still fails it."""
    a, _ = bc.make_tiny_model_dirs(tmp_path, arch="qwen2", seed=14)
    settings = [dict(temperature=0.7, top_k=3), dict(temperature=1.0, top_p=0.8)]
    bc.check_logprobs_match_forward(make_backend, a, settings=settings, max_tokens=6)

    class Shifted(EmbeddedBackend):
        async def generate(self, request):
            out = await super().generate(request)
            out.logprobs = [lp - 0.01 for lp in out.logprobs]
            return out

    with pytest.raises(AssertionError, match="temperature': 0.7"):
        bc.check_logprobs_match_forward(lambda d: Shifted(EmbeddedBackend.Config(), bc.default_context(d)), a,
                                        settings=settings, max_tokens=6)


def test_bf16_engine_tolerance_covers_bf16_itself(tmp_path):
    """The logprob tolerance :func:`bc.engine_options` gives 16-bit engines is measured, not guessed:
    transformers in bfloat16 against the float32 reference, on sampled responses of the tiny models
    the engine plugins' GPU tests use. It needs the loose bound (a float32 bound would fail) and
    stays inside it, and bf16's greedy token stays within the argmax allowance. (Over 80 such
    responses on four models the worst token differed by 1.11, the worst response by 0.13 on
    average, and bf16's greedy token fell up to 0.89 below the float32 argmax.)"""
    import random

    from transformers import AutoModelForCausalLM

    a, _ = bc.make_tiny_model_dirs(tmp_path, arch="qwen2", hidden_size=256, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=512)
    bf16 = AutoModelForCausalLM.from_pretrained(str(a), dtype=torch.bfloat16).eval()
    g, rng = torch.Generator().manual_seed(0), random.Random(0)
    worst, means, gaps = [], [], []
    for _ in range(10):
        prompt = [rng.randrange(3, 53) for _ in range(rng.randint(1, 12))]
        with torch.no_grad():
            seq = torch.tensor([prompt])
            for _ in range(16):  # sample from the float32 reference, as an engine's tokens would be
                probs = bc.reference_logprobs(a, prompt, seq[0, len(prompt):].tolist() + [0], 1.0)[-1].exp()
                seq = torch.cat([seq, torch.multinomial(probs, 1, generator=g)[None]], dim=1)
            response = torch.tensor(seq[0, len(prompt):].tolist())[:, None]
            want = bc.reference_logprobs(a, prompt, response[:, 0].tolist(), 1.0).gather(1, response)[:, 0]
            logits = bf16(seq).logits[0, len(prompt) - 1:-1].float()
            got = torch.log_softmax(logits, -1).gather(1, response)[:, 0]
            # a bf16 engine's greedy token at each position: how far below the float32 argmax it is
            ref = bc.reference_logprobs(a, prompt, response[:, 0].tolist(), 1.0)
            greedy = logits.argmax(-1, keepdim=True)
            gaps.append((ref.max(-1).values - ref.gather(1, greedy)[:, 0]).max().item())
        worst.append((got - want).abs().max().item())
        means.append((got - want).abs().mean().item())
    bf16_tol = bc.engine_options(torch.bfloat16)["logprobs_match_forward"]
    assert max(worst) > bc.engine_options(torch.float32)["logprobs_match_forward"]["atol"]
    assert max(worst) <= bf16_tol["atol"] and max(means) <= bf16_tol["mean_atol"], (worst, means)
    assert max(gaps) <= bf16_tol["argmax_atol"], gaps
    print(f"bf16 against float32: worst token {max(worst):.3f}, worst mean {max(means):.3f}, "
          f"worst greedy gap {max(gaps):.3f}")
