"""Load and isolation checks: many concurrent requests, and bad requests among good ones."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any, Iterable

from rlcli.backends.base import GenerateOutput
from rlcli.testing.backend_conformance.helpers import (
    VALID_FINISH,
    BackendFactory,
    _check_shape,
    _eos,
    _expected_finish,
    _gen,
    _random_prompts,
    _reference_model,
    _vocab_size,
)
from rlcli.testing.backend_conformance.sharing import _build, _done, _run


def many_concurrent_jobs(
    model_dir: str | Path, eos_ids: Iterable[int], n_prompts: int = 40, repeat: int = 8, max_tokens: int = 12,
) -> tuple[list[list[int]], list[tuple[list[int], dict[str, Any]]]]:
    """The request mix of :func:`check_many_concurrent`: ``n_prompts`` random prompts, each sent
    ``repeat`` times; every fourth prompt (index 0, 4, ...) greedy with ``max_tokens``, the others
    sampled (plain, top-k/top-p, or with ``min_tokens`` and the prompt's last token as a stop id).
    Returns ``(prompts, [(prompt, SampleParams keyword arguments), ...])``, the same for the same
    model directory and EOS ids (for diagnostics that replay the check's load)."""
    rng = random.Random(8)
    ps = _random_prompts(model_dir, n_prompts, rng, list(eos_ids), lengths=(1, 20))
    jobs = []
    for i, p in enumerate(ps):
        kind = i % 4
        for _ in range(repeat):
            if kind == 0:
                kw = dict(temperature=0.0, max_tokens=max_tokens)
            elif kind == 1:
                kw = dict(temperature=1.0, max_tokens=rng.randint(1, max_tokens))
            elif kind == 2:
                kw = dict(temperature=0.7, top_k=8, top_p=0.9, max_tokens=rng.randint(1, max_tokens))
            else:
                kw = dict(temperature=1.2, min_tokens=2, max_tokens=max_tokens, stop_token_ids=[p[-1]])
            jobs.append((p, kw))
    return ps, jobs


def check_many_concurrent(
    make_backend: BackendFactory,
    model_dir: str | Path,
    *,
    n_prompts: int = 40,
    repeat: int = 8,
    max_tokens: int = 12,
    batch_invariant: bool = True,
    copies_agree: bool = True,
    max_loop_lag_s: float | None = 2.0,
) -> None:
    """Hundreds of concurrent requests (groups of identical prompts, mixed sampling
    parameters) all complete with well-formed outputs; greedy copies of a prompt agree with
    each other (and, if ``batch_invariant``, with the prompt served alone); the event loop
    stays responsive (no gap over ``max_loop_lag_s``).

    ``copies_agree=False`` drops the comparison of greedy copies, for engines whose kernels'
    arithmetic depends on the batch a sequence is decoded in, so that two copies decoded beside
    different neighbours can part at a near tie (SGLang's default kernels, measured with
    ``benchmarks/backends.py --sections copies``; docs/backends.md)."""
    if batch_invariant and not copies_agree:
        raise ValueError("batch_invariant=True requires copies_agree=True (copies share one prompt)")

    async def main():
        backend = _build(make_backend, model_dir)
        try:
            eos = _eos(backend)
            ps, jobs = many_concurrent_jobs(model_dir, eos, n_prompts, repeat, max_tokens)
            lag = 0.0
            running = True

            async def ticker():
                nonlocal lag
                last = time.monotonic()
                while running:
                    await asyncio.sleep(0.005)
                    now = time.monotonic()
                    lag = max(lag, now - last)
                    last = now

            tick = asyncio.ensure_future(ticker())
            outs = await asyncio.gather(*(_gen(backend, p, **kw) for p, kw in jobs))
            running = False
            await tick
            solo = {}
            if batch_invariant:
                for i, p in enumerate(ps):
                    if i % 4 == 0:
                        solo[tuple(p)] = (await _gen(backend, p, temperature=0.0, max_tokens=max_tokens)).token_ids
        finally:
            _done(backend)
        greedy: dict[tuple, list[int]] = {}
        for (p, kw), out in zip(jobs, outs):
            what = f"request {p} {kw}"
            _check_shape(out, what, kw["max_tokens"])
            assert out.finish_reason in VALID_FINISH, f"{what}: finish_reason {out.finish_reason!r} ({out.error})"
            stops = set(eos) | set(kw.get("stop_token_ids", []))
            assert out.finish_reason == _expected_finish(out.token_ids, stops), f"{what}: wrong finish_reason"
            if out.finish_reason == "length":
                assert len(out.token_ids) == kw["max_tokens"], f"{what}: 'length' with {len(out.token_ids)} tokens"
            assert not stops.intersection(out.token_ids[:-1]), f"{what}: generation continued past a stop token"
            if kw.get("min_tokens"):
                assert len(out.token_ids) >= kw["min_tokens"], f"{what}: fewer than min_tokens"
            if kw["temperature"] == 0.0 and copies_agree:
                prev = greedy.setdefault(tuple(p), out.token_ids)
                assert prev == out.token_ids, f"greedy copies of {p} differ: {prev} vs {out.token_ids}"
        for key, tokens in solo.items():
            assert greedy[key] == tokens, f"greedy {list(key)} differs in a batch ({greedy[key]}) and alone ({tokens})"
        if max_loop_lag_s is not None:
            assert lag <= max_loop_lag_s, f"the event loop was blocked for {lag:.2f}s during generation"

    _run(main)


def check_invalid_requests_isolated(make_backend: BackendFactory, model_dir: str | Path) -> None:
    """Bad requests (token id outside the vocabulary, empty prompt, prompt longer than the
    model's context) end with finish "error" and a message (or raise), and requests served
    alongside them are unaffected."""

    async def main():
        backend = _build(make_backend, model_dir)
        try:
            eos = _eos(backend)
            vocab = _vocab_size(model_dir)
            ps = _random_prompts(model_dir, 3, random.Random(9), eos)
            max_pos = int(_reference_model(model_dir).config.max_position_embeddings)
            bad = [[1, vocab + 5, 2], [], [3] * (max_pos + 1)]
            good_alone = [(await _gen(backend, p, temperature=0.0, max_tokens=8)).token_ids for p in ps]
            tasks = [_gen(backend, p, temperature=0.0, max_tokens=8) for p in ps]
            tasks += [_gen(backend, b, temperature=0.0, max_tokens=8) for b in bad]
            results = await asyncio.gather(*tasks, return_exceptions=True)
            after = [(await _gen(backend, p, temperature=0.0, max_tokens=8)).token_ids for p in ps]
        finally:
            _done(backend)
        for p, res, want in zip(ps, results[: len(ps)], good_alone):
            assert isinstance(res, GenerateOutput), f"a good request failed next to bad ones: {res!r}"
            assert res.token_ids == want, f"good request {p} changed next to bad ones"
        for b, res in zip(bad, results[len(ps) :]):
            what = f"bad prompt of {len(b)} tokens"
            if isinstance(res, BaseException):
                assert isinstance(res, (ValueError, RuntimeError)), f"{what} raised {res!r}"
            else:
                assert res.finish_reason == "error" and res.error, (
                    f"{what}: finish {res.finish_reason!r}, error {res.error!r}"
                )
        assert after == good_alone, "the backend serves differently after bad requests"

    _run(main)
