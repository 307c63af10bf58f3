"""The multi_turn agent loop over the embedded engine: partial rollout across turns is token-exact.

A tiny llama over the ``builtin:calc`` tokenizer, served by the embedded backend, runs calculator
episodes with the line tool format; a turn aborted part-way (by an aborting wrapper, or by pausing the
engine under a whole group) and then resumed gives exactly the episode of an uninterrupted run. The
test doubles (``AbortingBackend``, ``FakePool``, ``make_sample``) live in tests/test_multi_turn.py.
"""

from __future__ import annotations

import asyncio

import pytest

from rlcli.agent_loops.multi_turn import (
    LineFormatConfig, MultiTurnAgentLoop, MultiTurnConfig, count_turns, episode_stats,
)
from rlcli.tokenizer import load_tokenizer
from rlcli.tools import Calculator
from rlcli.types import Sample, SampleParams, Status
from tests.test_multi_turn import AbortingBackend, FakePool, make_sample


@pytest.fixture(scope="module")
def calc_backend(tmp_path_factory):
    from rlcli.backends.embedded import EmbeddedBackend
    from rlcli.config import FromScratch
    from rlcli.models import build_from_scratch
    from rlcli.testing.backend_conformance import default_context

    tok = load_tokenizer("builtin:calc")
    tok._rlcli_builtin = "builtin:calc"
    spec = FromScratch(arch="llama", hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=64, max_position_embeddings=128).model_dump()
    model_dir = build_from_scratch("llama", spec, tok, 0, tmp_path_factory.mktemp("calc") / "model")
    backend = EmbeddedBackend(EmbeddedBackend.Config(max_batch_size=64), default_context(model_dir))
    yield tok, backend
    backend.shutdown()


def embedded_loop(tok, backend, pool=None) -> MultiTurnAgentLoop:
    cfg = MultiTurnConfig(sample_params=SampleParams(max_tokens=48, temperature=1.0), max_turns=4,
                          max_tokens_per_turn=12, tool_format=LineFormatConfig(error_template="?\n"))
    return MultiTurnAgentLoop(cfg, backend=backend, judge_pool=pool or FakePool(), tokenizer=tok,
                              eos_token_ids=[tok.eos_token_id], seed=3, salt="train:t", tools=[Calculator()])


def _fields(s: Sample):
    return (s.response_ids, s.response_mask, s.token_versions, s.finish_reason, s.status, s.response)


def test_real_engine_partial_rollout_across_turns_is_exact(calc_backend):
    tok, backend = calc_backend
    loop = embedded_loop(tok, backend)
    samples = [make_sample(tok, f"{12 + i}*{34 + i}", uid=i) for i in range(48)]
    asyncio.run(loop.run_group(samples))
    multi = [s for s in samples if count_turns(s.response_mask) >= 3]
    assert len(multi) >= 2, [count_turns(s.response_mask) for s in samples]
    for full in multi[:3]:
        turn2 = [i for i, _ in enumerate(full.response_mask) if count_turns(full.response_mask[: i + 1]) == 2
                 and full.response_mask[i]]
        for k in sorted({0, 1, len(turn2) // 2, len(turn2) - 1}):
            s = make_sample(tok, full.prompt_text, uid=full.uid)
            aborting = AbortingBackend(backend, nth=2, k=k)  # the 2nd request is turn 2
            asyncio.run(embedded_loop(tok, aborting).run_sample(s))
            assert s.status == Status.ABORTED and len(s.response_ids) == turn2[0] + k
            asyncio.run(embedded_loop(tok, backend).run_sample(s))
            assert _fields(s) == _fields(full), (full.uid, k)
            assert s.logprobs == pytest.approx(full.logprobs, abs=1e-4)
            assert episode_stats(s) == episode_stats(full)


def test_real_engine_pause_and_resume_of_a_group(calc_backend):
    tok, backend = calc_backend
    loop = embedded_loop(tok, backend)
    prompts = [f"{7 * i + 10}*{3 * i + 11}" for i in range(32)]
    ref = [make_sample(tok, p, uid=i) for i, p in enumerate(prompts)]
    asyncio.run(loop.run_group(ref))

    async def paused_midway(samples):
        task = asyncio.ensure_future(loop.run_group(samples))
        await asyncio.sleep(0.02)
        backend.pause()
        await task
        backend.resume()

    samples = [make_sample(tok, p, uid=i) for i, p in enumerate(prompts)]
    asyncio.run(paused_midway(samples))
    for s in samples:
        if s.status == Status.ABORTED:
            asyncio.run(loop.run_sample(s))
    for s, r in zip(samples, ref):
        assert _fields(s) == _fields(r), s.uid
