"""Generation checks: greedy parity, logprobs, stop/length, ``min_tokens`` and seeded sampling."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any, Sequence

import torch

from rlcli.testing.backend_conformance.helpers import (
    BackendFactory,
    _check_shape,
    _eos,
    _expected_finish,
    _gen,
    _random_prompts,
    reference_greedy,
    reference_logprobs,
)
from rlcli.testing.backend_conformance.sharing import _build, _done, _run


def check_greedy_matches_reference(
    make_backend: BackendFactory,
    model_dir: str | Path,
    *,
    prompts: Sequence[list[int]] | None = None,
    max_tokens: int = 24,
    min_exact_fraction: float = 1.0,
) -> None:
    """Greedy outputs equal ``transformers.generate(do_sample=False)`` in float32.

    Each prompt is sent twice concurrently (both copies must agree). The finish reason must be
    "stop" exactly when the last token is an EOS id, and every token must carry the backend's
    version. ``min_exact_fraction`` is the share of prompts that must match token for token.
    """

    async def main():
        backend = _build(make_backend, model_dir)
        try:
            eos = _eos(backend)
            ps = list(prompts) if prompts is not None else _random_prompts(model_dir, 6, random.Random(1), eos)
            reqs = [p for p in ps for _ in range(2)]
            outs = await asyncio.gather(*(_gen(backend, p, temperature=0.0, max_tokens=max_tokens) for p in reqs))
            version = backend.version
        finally:
            _done(backend)
        exact = 0
        for i, p in enumerate(ps):
            a, b = outs[2 * i], outs[2 * i + 1]
            for o in (a, b):
                _check_shape(o, f"greedy prompt {p}", max_tokens)
                assert o.finish_reason == _expected_finish(o.token_ids, eos), (
                    f"greedy prompt {p}: finish_reason {o.finish_reason!r} for tokens {o.token_ids} (eos {eos})"
                )
                assert all(v == version for v in o.versions), f"versions {o.versions} != backend version {version}"
            assert a.token_ids == b.token_ids, f"two greedy copies of {p} differ: {a.token_ids} vs {b.token_ids}"
            ref = reference_greedy(model_dir, p, max_tokens, eos)
            exact += a.token_ids == ref
            if min_exact_fraction >= 1.0:
                assert a.token_ids == ref, f"greedy output for {p}:\n  backend   {a.token_ids}\n  reference {ref}"
        assert exact >= min_exact_fraction * len(ps), f"only {exact}/{len(ps)} greedy outputs match the reference"

    _run(main)


def check_logprobs_match_forward(
    make_backend: BackendFactory,
    model_dir: str | Path,
    *,
    temperatures: Sequence[float] = (1.0, 0.7, 0.0),
    atol: float = 1e-4,
    max_tokens: int = 16,
    settings: Sequence[dict[str, Any]] | None = None,
    mean_atol: float | None = None,
    argmax_atol: float = 1e-5,
) -> None:
    """Returned logprobs equal ``log_softmax(logits / T)`` of a transformers forward pass.

    ``atol`` bounds the largest per-token difference of a response, ``mean_atol`` (optional) its
    mean. A greedy (temperature 0) token must be the reference's argmax, or within
    ``argmax_atol`` of the reference's largest logprob (two near-tied logits can swap order
    under another rounding). The reference is a float32 forward pass, so an engine computing in
    bfloat16 needs all three loosened by its own rounding (:func:`engine_options`).

    Also with top-k/top-p active: the logprob is *not* renormalised over the kept set, and
    every sampled token lies in the top-k set. ``settings`` (sampling parameters such as
    ``{"temperature": 1.0, "top_k": 5}``) replaces the default mix (``temperatures`` plus two
    top-k/top-p requests): every prompt is then sent with each of them - for engines whose
    logprobs are exact only in part of the range.
    """

    async def main():
        backend = _build(make_backend, model_dir)
        try:
            eos = _eos(backend)
            ps = _random_prompts(model_dir, 4, random.Random(2), eos)
            jobs = []
            fixed = dict(max_tokens=max_tokens, ignore_eos=True)
            if settings is not None:
                for j, st in enumerate(settings):
                    jobs += [(p, {**fixed, **st}, 100 * (j + 1) + i) for i, p in enumerate(ps)]
            else:
                for t in temperatures:
                    jobs += [(p, dict(temperature=t, **fixed), 100 + i) for i, p in enumerate(ps)]
                jobs.append((ps[0], dict(temperature=1.0, top_k=5, top_p=0.9, **fixed), 7))
                jobs.append((ps[1], dict(temperature=0.8, top_k=3, **fixed), 8))
            outs = await asyncio.gather(*(_gen(backend, p, seed=s, **kw) for p, kw, s in jobs))
        finally:
            _done(backend)
        for (p, kw, _), out in zip(jobs, outs):
            what = f"prompt {p} with {kw}"
            _check_shape(out, what, max_tokens)
            assert len(out.token_ids) == max_tokens and out.finish_reason == "length", (
                f"{what}: expected {max_tokens} tokens with ignore_eos, got {len(out.token_ids)} ({out.finish_reason})"
            )
            ref = reference_logprobs(model_dir, p, out.token_ids, kw["temperature"])
            got = torch.tensor(out.logprobs, dtype=torch.float32)
            want = ref.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
            diff = (got - want).abs()
            err, mean = diff.max().item(), diff.mean().item()
            i = int(diff.argmax())
            detail = (f"largest at position {i} of {len(diff)} (token {out.token_ids[i]}: engine {got[i].item():.4g}, "
                      f"forward {want[i].item():.4g}); mean difference {mean:.3g}; response {list(out.token_ids)}")
            assert err <= atol, f"{what}: logprobs differ from the forward pass by {err:.3g} (atol {atol}); {detail}"
            assert mean_atol is None or mean <= mean_atol, (
                f"{what}: logprobs differ from the forward pass by {mean:.3g} on average (mean_atol {mean_atol}); {detail}"
            )
            if kw.get("top_k"):
                k = kw["top_k"]
                kth = ref.topk(k, dim=-1).values[:, -1]
                assert bool((want >= kth - 1e-5).all()), f"{what}: a sampled token is outside the top-{k} set"
            if kw["temperature"] == 0.0:
                gap = ref.max(dim=-1).values - want
                j = int(gap.argmax())
                assert gap[j].item() <= argmax_atol, (
                    f"{what}: greedy token {out.token_ids[j]} at position {j} is not the argmax: its reference "
                    f"logprob is {gap[j].item():.3g} below the largest (argmax_atol {argmax_atol})"
                )

    _run(main)


def check_stop_and_length(make_backend: BackendFactory, model_dir: str | Path, *, max_tokens: int = 24) -> None:
    """``max_tokens`` / ``ignore_eos`` / ``stop_token_ids`` / EOS end responses where they must.

    * ``ignore_eos`` generates exactly ``max_tokens`` tokens (finish "length");
    * a stop token id ends the response right after its first occurrence, included
      (finish "stop"); a smaller ``max_tokens`` ends it first (finish "length");
    * without ``ignore_eos`` the response ends at the first EOS (checked when the greedy
      continuation contains one);
    * ``return_logprob: false`` gives the same greedy responses with no logprobs (an engine may
      then skip computing them).
    """

    async def main():
        backend = _build(make_backend, model_dir)
        try:
            eos = set(_eos(backend))
            ps = _random_prompts(model_dir, 4, random.Random(3), eos)
            full = await asyncio.gather(
                *(_gen(backend, p, temperature=0.0, max_tokens=max_tokens, ignore_eos=True) for p in ps)
            )
            for p, out in zip(ps, full):
                _check_shape(out, f"ignore_eos {p}", max_tokens)
                assert len(out.token_ids) == max_tokens and out.finish_reason == "length", (
                    f"ignore_eos: expected exactly {max_tokens} tokens, got {len(out.token_ids)} ({out.finish_reason})"
                )
            bare = await asyncio.gather(*(_gen(backend, p, temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                               return_logprob=False) for p in ps))
            for p, out, b in zip(ps, full, bare):
                assert (b.token_ids, b.finish_reason, b.logprobs, len(b.versions)) == (
                    out.token_ids, "length", [], max_tokens), (
                    f"return_logprob=false on {p}: expected {out.token_ids} (length) without logprobs, got "
                    f"{b.token_ids} ({b.finish_reason}), {len(b.logprobs)} logprobs, {len(b.versions)} versions")
            for p, out in zip(ps, full):
                g = out.token_ids
                # the stop token whose first occurrence comes latest (most informative)
                firsts = {t: g.index(t) for t in set(g)}
                stop_tok = max(firsts, key=lambda t: (firsts[t], t))
                j = firsts[stop_tok]
                kw = dict(temperature=0.0, ignore_eos=True, stop_token_ids=[stop_tok])
                res = await _gen(backend, p, max_tokens=max_tokens, **kw)
                assert res.token_ids == g[: j + 1] and res.finish_reason == "stop", (
                    f"stop_token_ids=[{stop_tok}] on {p}: expected {g[: j + 1]} (stop), "
                    f"got {res.token_ids} ({res.finish_reason})"
                )
                if j >= 1:
                    res = await _gen(backend, p, max_tokens=j, **kw)
                    assert res.token_ids == g[:j] and res.finish_reason == "length", (
                        f"max_tokens={j} before the stop token: expected {g[:j]} (length), "
                        f"got {res.token_ids} ({res.finish_reason})"
                    )
                eos_at = [i for i, t in enumerate(g) if t in eos]
                if eos_at:
                    res = await _gen(backend, p, temperature=0.0, max_tokens=max_tokens)
                    k = eos_at[0]
                    assert res.token_ids == g[: k + 1] and res.finish_reason == "stop", (
                        f"EOS: expected {g[: k + 1]} (stop), got {res.token_ids} ({res.finish_reason})"
                    )
        finally:
            _done(backend)

    _run(main)


def check_min_tokens(make_backend: BackendFactory, model_dir: str | Path, *, min_tokens: int = 5) -> None:
    """No stop token (EOS or ``stop_token_ids``) is produced before ``min_tokens`` tokens.

    The greedy first token is made a stop token: without ``min_tokens`` the response is that
    one token; with it, the first ``min_tokens`` tokens contain no stop id. Sampled requests
    are checked the same way.
    """

    async def main():
        backend = _build(make_backend, model_dir)
        try:
            eos = set(_eos(backend))
            ps = _random_prompts(model_dir, 3, random.Random(4), eos)
            for p in ps:
                first = (await _gen(backend, p, temperature=0.0, max_tokens=1)).token_ids
                stop = first[0]
                alone = await _gen(backend, p, temperature=0.0, max_tokens=8, stop_token_ids=[stop])
                assert alone.token_ids == [stop] and alone.finish_reason == "stop", (
                    f"without min_tokens expected [{stop}] (stop), got {alone.token_ids} ({alone.finish_reason})"
                )
                cap = min_tokens + 8
                kw = dict(max_tokens=cap, min_tokens=min_tokens, stop_token_ids=[stop])
                outs = await asyncio.gather(
                    _gen(backend, p, temperature=0.0, **kw),
                    *(_gen(backend, p, seed=s, temperature=1.0, **kw) for s in range(4)),
                )
                stops = eos | {stop}
                for out in outs:
                    _check_shape(out, f"min_tokens on {p}", cap)
                    head = out.token_ids[:min_tokens]
                    assert len(out.token_ids) >= min_tokens, f"min_tokens={min_tokens}: only {out.token_ids}"
                    assert not stops.intersection(head), (
                        f"min_tokens={min_tokens}: stop token among the first tokens {head} (stop ids {sorted(stops)})"
                    )
                    assert out.finish_reason == _expected_finish(out.token_ids, stops)
        finally:
            _done(backend)

    _run(main)


def check_seeded_sampling_batch_invariant(
    make_backend: BackendFactory, model_dir: str | Path, *, n_others: int = 50, max_tokens: int = 16
) -> None:
    """A request with a seed yields the same tokens alone and inside a batch of ``n_others``
    other requests; the same seed twice gives the same tokens, other seeds other tokens."""

    async def main():
        backend = _build(make_backend, model_dir)
        try:
            eos = _eos(backend)
            rng = random.Random(5)
            p = _random_prompts(model_dir, 1, rng, eos, lengths=(4, 8))[0]
            kw = dict(temperature=1.0, top_p=0.95, max_tokens=max_tokens, ignore_eos=True)
            alone = await _gen(backend, p, seed=1234, **kw)
            others = _random_prompts(model_dir, n_others, rng, eos, lengths=(1, 16))
            tasks = [
                _gen(backend, q, temperature=rng.choice([0.0, 0.6, 1.0]), max_tokens=rng.randint(1, 2 * max_tokens))
                for q in others
            ]
            # the seeded request is admitted in the middle of the others
            tasks.insert(n_others // 2, _gen(backend, p, seed=1234, **kw))
            tasks.append(_gen(backend, p, seed=1234, **kw))
            tasks.append(_gen(backend, p, seed=4321, **kw))
            outs = await asyncio.gather(*tasks)
        finally:
            _done(backend)
        mixed, again, other = outs[n_others // 2], outs[-2], outs[-1]
        assert mixed.token_ids == alone.token_ids, (
            f"seeded request differs inside a batch:\n  alone {alone.token_ids}\n  batch {mixed.token_ids}"
        )
        assert again.token_ids == alone.token_ids, "the same seed twice in one batch gave different tokens"
        assert other.token_ids != alone.token_ids, "different seeds gave identical samples"

    _run(main)
