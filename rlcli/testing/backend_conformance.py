"""Conformance checks for inference backends (the contract of :mod:`rlcli.backends.base`).

Every check is a plain function that raises ``AssertionError`` with an explanation when the
backend misbehaves, so a backend author can call it from any test runner::

    from rlcli.testing import backend_conformance as bc

    def make_backend(model_dir):
        return MyBackend(MyBackend.Config(), bc.default_context(model_dir))

    def test_my_backend(tmp_path):
        model_dir, other_dir = bc.make_tiny_model_dirs(tmp_path, arch="qwen2")
        bc.run_all(make_backend, model_dir, other_dir)

A *factory* ``make_backend(model_dir) -> InferenceBackend`` builds a fresh backend for a
Hugging Face model directory; checks shut down every backend they build, except inside
:func:`reusing_backends` (``run_all(..., reuse=True)``), where consecutive checks share one. References are
computed with ``transformers`` in float32 on CPU: greedy continuations with
``generate(do_sample=False)`` and logprobs with ``log_softmax(model(prompt + response).logits
/ T)``. Engines that compute in bfloat16 or whose kernels depend on the batch can loosen the
``atol`` / ``min_exact_fraction`` / ``exact_continuation`` / ``batch_invariant`` knobs;
:func:`engine_options` gives the settings the project's GPU engines use per dtype.

Checks that need CUDA (memory release in :func:`check_sleep_wake`) only run their CUDA part
when the backend's context names a CUDA device.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from rlcli.backends.base import BackendContext, GenerateOutput, GenerateRequest, InferenceBackend
from rlcli.types import SampleParams

BackendFactory = Callable[[str | Path], InferenceBackend]
"""Builds a fresh backend serving the model in the given directory."""

VALID_FINISH = {"stop", "length"}

__all__ = [
    "BackendFactory",
    "default_context",
    "make_tiny_model_dirs",
    "check_greedy_matches_reference",
    "check_logprobs_match_forward",
    "check_stop_and_length",
    "check_min_tokens",
    "check_seeded_sampling_batch_invariant",
    "check_pause_returns_partial_and_continue",
    "check_weight_update",
    "check_many_concurrent",
    "many_concurrent_jobs",
    "check_invalid_requests_isolated",
    "check_sleep_wake",
    "check_sleep_frees_device_memory",
    "ALL_CHECKS",
    "engine_options",
    "run_all",
    "reusing_backends",
]


# ------------------------------------------------------------------------------------------
# Helpers for backend authors
# ------------------------------------------------------------------------------------------
def default_context(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    version: int = 0,
) -> BackendContext:
    """A :class:`BackendContext` for ``model_dir`` with EOS/pad ids read from its tokenizer
    and ``generation_config.json``."""
    from rlcli.tokenizer import eos_token_ids, load_tokenizer

    tok = load_tokenizer(model_dir)
    return BackendContext(
        model_dir=str(model_dir),
        device=torch.device(device),
        dtype=dtype,
        eos_token_ids=eos_token_ids(tok, model_dir),
        pad_token_id=tok.pad_token_id,
        seed=seed,
        version=version,
    )


def make_tiny_model_dirs(root: str | Path, arch: str = "qwen2", seed: int = 0, **spec: Any) -> tuple[Path, Path]:
    """Two tiny random models of the same shape (``<root>/<arch>-a``, ``<root>/<arch>-b``).

    The default initialisation of a tiny model yields nearly uniform next-token
    distributions, so greedy decoding just repeats a token. These models are re-initialised
    with larger weights so greedy continuations vary and sometimes reach EOS, which makes the
    checks meaningful. ``spec`` goes to :func:`rlcli.models.tiny_model_dir`.
    """
    from rlcli.models import tiny_model_dir

    root = Path(root)
    dirs = []
    for i, name in enumerate(("a", "b")):
        out = tiny_model_dir(root / f"{arch}-{name}", arch=arch, seed=seed + i, **spec)
        _sharpen_model_dir(out, seed=seed + 1000 + i)
        dirs.append(out)
    return dirs[0], dirs[1]


def _sharpen_model_dir(model_dir: Path, seed: int, gain: float = 3.0, embed_std: float = 0.35) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = embed_std if "embed_tokens" in name else gain / math.sqrt(p.shape[1])
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    model.save_pretrained(str(model_dir))


_REFERENCE_CACHE: dict[tuple[str, float], torch.nn.Module] = {}


def _reference_model(model_dir: str | Path) -> torch.nn.Module:
    """The float32 CPU transformers model of ``model_dir`` (cached while the files are unchanged)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(model_dir)
    stamp = max((f.stat().st_mtime for f in path.iterdir() if f.is_file()), default=0.0)
    key = (str(path.resolve()), stamp)
    model = _REFERENCE_CACHE.get(key)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        model.eval()
        # neutral generation settings: the directory's (repetition penalty, ...) must not apply
        model.generation_config = GenerationConfig()
        _REFERENCE_CACHE.clear()  # keep one model: tests walk several directories
        _REFERENCE_CACHE[key] = model
    return model


@torch.no_grad()
def reference_greedy(model_dir: str | Path, prompt: list[int], max_tokens: int, eos_ids: Iterable[int]) -> list[int]:
    """Greedy continuation of ``prompt`` by ``transformers.generate`` in float32 on CPU."""
    model = _reference_model(model_dir)
    eos = list(eos_ids)
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_tokens,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else 0,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def reference_logprobs(
    model_dir: str | Path, prompt: list[int], response: list[int], temperature: float
) -> torch.Tensor:
    """Per-position ``log_softmax(logits / T)`` ``[len(response), V]`` of a float32 forward."""
    model = _reference_model(model_dir)
    logits = model(torch.tensor([prompt + response])).logits[0].float()
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(response)] / t, dim=-1)


def _vocab_size(model_dir: str | Path) -> int:
    return int(_reference_model(model_dir).config.vocab_size)


def _random_prompts(model_dir, n: int, rng: random.Random, eos_ids, lengths=(1, 12)) -> list[list[int]]:
    vocab = _vocab_size(model_dir)
    avoid = set(eos_ids)
    low = 3 if vocab > 8 else 0  # skip the usual special ids at the start of the vocabulary
    prompts = []
    for _ in range(n):
        length = rng.randint(*lengths)
        p: list[int] = []
        while len(p) < length:
            t = rng.randrange(low, vocab)
            if t not in avoid:
                p.append(t)
        prompts.append(p)
    return prompts


def _run(main: Callable[[], Any]) -> Any:
    """Run an async check body on a fresh event loop. A failing check shuts down the backend it
    shares (:func:`reusing_backends`), so the next check starts clean."""
    try:
        return asyncio.run(main())
    except BaseException:
        if _SHARED is not None:
            _SHARED.close()
        raise


class _Shared:
    """The one live backend that checks share inside :func:`reusing_backends`."""

    def __init__(self) -> None:
        self.key: tuple[int, str] | None = None
        self.backend: InferenceBackend | None = None
        self.built = 0

    def close(self) -> None:
        backend, self.backend, self.key = self.backend, None, None
        if backend is not None:
            backend.shutdown()


_SHARED: _Shared | None = None


@contextlib.contextmanager
def reusing_backends():
    """Within this block, consecutive checks on the same factory and model directory share one
    backend instead of building one each: for engines whose start-up takes a minute, this is
    what makes the whole kit fit in one sitting. At most one backend is alive at a time (some
    engines allow one per process); a check that fails shuts its backend down, so the next check
    starts clean; each check hands the backend back resumed. :func:`check_sleep_wake` always
    builds its own (it measures the memory a backend holds). Yields an object whose ``built``
    counts the backends built."""
    global _SHARED
    previous, _SHARED = _SHARED, _Shared()
    shared = _SHARED
    try:
        yield shared
    finally:
        _SHARED = previous
        shared.close()


def _build(make_backend: BackendFactory, model_dir, fresh: bool = False) -> InferenceBackend:
    shared = _SHARED
    key = (id(make_backend), str(model_dir))
    if shared is not None:
        if not fresh and shared.key == key and shared.backend is not None:
            return shared.backend
        shared.close()  # one live backend at a time
    backend = make_backend(model_dir)
    if not isinstance(backend, InferenceBackend):
        raise AssertionError(f"the factory returned {type(backend).__name__}, not an InferenceBackend")
    if shared is not None:
        shared.built += 1
        if not fresh:
            shared.key, shared.backend = key, backend
    return backend


def _done(backend: InferenceBackend) -> None:
    """End a check's use of ``backend``: shut it down, unless it is the shared backend of
    :func:`reusing_backends` (then it is handed back resumed; :func:`_run` shuts it down if the
    check fails)."""
    shared = _SHARED
    if shared is not None and shared.backend is backend:
        backend.resume()
        return
    backend.shutdown()


def _eos(backend: InferenceBackend) -> list[int]:
    return list(getattr(backend, "ctx", None).eos_token_ids or [])


async def _gen(backend: InferenceBackend, prompt: list[int], seed: int | None = None, **params: Any) -> GenerateOutput:
    return await backend.generate(GenerateRequest(list(prompt), SampleParams(**params), seed=seed))


def _check_shape(out: GenerateOutput, what: str, max_tokens: int | None = None) -> None:
    n = len(out.token_ids)
    assert len(out.logprobs) == n and len(out.versions) == n, (
        f"{what}: token_ids/logprobs/versions lengths differ: {n}, {len(out.logprobs)}, {len(out.versions)}"
    )
    if max_tokens is not None:
        assert n <= max_tokens, f"{what}: {n} tokens generated but max_tokens={max_tokens}"
    for lp in out.logprobs:
        assert math.isfinite(lp) and lp <= 1e-5, f"{what}: invalid logprob {lp}"


def _expected_finish(tokens: list[int], stop_ids: Iterable[int]) -> str:
    return "stop" if tokens and tokens[-1] in set(stop_ids) else "length"


# ------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------
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
      continuation contains one).
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


def check_pause_returns_partial_and_continue(
    make_backend: BackendFactory,
    model_dir: str | Path,
    *,
    n_requests: int = 8,
    max_tokens: int = 200,
    exact_continuation: bool = True,
    timeout_s: float = 60.0,
) -> None:
    """``pause()`` ends in-flight requests with "abort" and their partial tokens; requests
    made while paused return "abort" with no tokens; after ``resume()`` a partial response
    continued with ``prompt + partial`` and the remaining budget completes without ever
    exceeding ``max_tokens`` (and, greedy, equals the uninterrupted response when
    ``exact_continuation``)."""

    async def main():
        backend = _build(make_backend, model_dir)
        try:
            eos = _eos(backend)
            ps = _random_prompts(model_dir, max(1, n_requests // 2), random.Random(6), eos, lengths=(2, 6))
            reqs = [ps[i % len(ps)] for i in range(n_requests)]
            kw = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            reference = {tuple(p): (await _gen(backend, p, **kw)).token_ids for p in ps}
            outs = None
            for delay in (0.01, 0.03, 0.1, 0.3, 1.0, 3.0):
                tasks = [asyncio.ensure_future(_gen(backend, p, **kw)) for p in reqs]
                await asyncio.sleep(delay)
                backend.pause()
                t0 = time.monotonic()
                outs = await asyncio.wait_for(asyncio.gather(*tasks), timeout_s)
                assert time.monotonic() - t0 < timeout_s
                late = await asyncio.wait_for(_gen(backend, reqs[0], **kw), timeout_s)
                assert late.finish_reason == "abort" and not late.token_ids, (
                    f"a request made while paused must return 'abort' with no tokens, got {late.finish_reason} "
                    f"with {len(late.token_ids)} tokens"
                )
                backend.resume()
                if any(o.finish_reason == "abort" and o.token_ids for o in outs):
                    break
                if all(o.finish_reason != "abort" for o in outs):
                    raise AssertionError(
                        f"all requests finished within {delay}s, before pause(); raise max_tokens (now {max_tokens})"
                    )
            else:
                raise AssertionError("pause() never caught a request with partial tokens")
            version = backend.version
            partial = []
            for p, out in zip(reqs, outs):
                _check_shape(out, f"paused request {p}", max_tokens)
                assert out.finish_reason in ("abort", "length"), f"unexpected finish {out.finish_reason!r} after pause"
                assert all(v == version for v in out.versions)
                if out.finish_reason == "length":
                    assert out.token_ids == reference[tuple(p)]
                    continue
                assert len(out.token_ids) < max_tokens, "an aborted request already had all its tokens"
                want = reference[tuple(p)][: len(out.token_ids)]
                assert out.token_ids == want, "partial tokens differ from the greedy run"
                if out.token_ids:
                    partial.append((p, out))
            assert partial
            rest_kw = dict(temperature=0.0, ignore_eos=True)
            conts = await asyncio.gather(
                *(_gen(backend, p + o.token_ids, max_tokens=max_tokens - len(o.token_ids), **rest_kw) for p, o in partial)
            )
            for (p, out), cont in zip(partial, conts):
                rest = max_tokens - len(out.token_ids)
                _check_shape(cont, "continuation", rest)
                total = out.token_ids + cont.token_ids
                assert cont.finish_reason == "length" and len(total) == max_tokens, (
                    f"continuation: {len(out.token_ids)} + {len(cont.token_ids)} tokens ({cont.finish_reason}), "
                    f"expected {max_tokens} in total"
                )
                if exact_continuation:
                    assert total == reference[tuple(p)], (
                        "partial + continuation differs from the uninterrupted greedy run"
                    )
        finally:
            _done(backend)

    _run(main)


def check_weight_update(
    make_backend: BackendFactory,
    model_dir: str | Path,
    other_model_dir: str | Path,
    *,
    max_tokens: int = 16,
    check_unknown_name: bool = True,
) -> None:
    """``update_weights`` with another model's weights (in two partial calls) makes greedy
    outputs equal a fresh backend built from that model; later tokens carry the new version;
    a pause / update / resume in the middle of generation splits versions accordingly;
    unknown names raise ``ValueError`` naming them."""
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(str(other_model_dir), dtype=torch.float32)
    other_sd = list(other.state_dict().items())
    mine = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    mine_sd = list(mine.state_dict().items())

    async def greedy(backend, ps, n=max_tokens):
        return await asyncio.gather(*(_gen(backend, p, temperature=0.0, max_tokens=n, ignore_eos=True) for p in ps))

    async def main():
        backend = _build(make_backend, other_model_dir)
        try:
            eos = _eos(backend)
            ps = _random_prompts(model_dir, 4, random.Random(7), eos)
            expected = [o.token_ids for o in await greedy(backend, ps)]
        finally:
            _done(backend)

        backend = _build(make_backend, model_dir)
        try:
            before = [o.token_ids for o in await greedy(backend, ps)]
            assert before != expected, "the two models give the same greedy outputs; use more different models"
            v1 = backend.version + 7
            half = len(other_sd) // 2
            backend.update_weights(iter(other_sd[:half]), v1)
            backend.update_weights(iter(other_sd[half:]), v1)
            assert backend.version == v1, f"version is {backend.version} after update_weights(..., {v1})"
            after = await greedy(backend, ps)
            for p, o, e in zip(ps, after, expected):
                assert o.token_ids == e, f"after update, prompt {p}:\n  backend {o.token_ids}\n  expected {e}"
                assert o.versions == [v1] * len(o.token_ids), f"versions after update: {o.versions}"

            if check_unknown_name:
                bogus = [("model.layers.0.no_such_weight", torch.zeros(1)), ("totally.unknown", torch.zeros(1))]
                try:
                    backend.update_weights(bogus, v1 + 100)
                except ValueError as exc:
                    assert "no_such_weight" in str(exc) and "totally.unknown" in str(exc), (
                        f"the ValueError must name the unknown tensors: {exc}"
                    )
                else:
                    raise AssertionError("update_weights with unknown names did not raise ValueError")
                assert backend.version == v1, "a failed update_weights changed the version"

            # mid-generation: pause, update back to the original weights, resume, continue
            long_tokens = 4 * max_tokens
            p = ps[0]
            for delay in (0.01, 0.03, 0.1, 0.3, 1.0):
                task = asyncio.ensure_future(_gen(backend, p, temperature=0.0, max_tokens=long_tokens, ignore_eos=True))
                await asyncio.sleep(delay)
                backend.pause()
                part = await task
                if part.finish_reason == "abort" and part.token_ids:
                    break
                backend.resume()
            else:
                raise AssertionError("could not pause a request mid-generation")
            v2 = v1 + 1
            backend.update_weights(mine_sd, v2)
            backend.resume()
            remaining = long_tokens - len(part.token_ids)
            rest = await _gen(backend, p + part.token_ids, temperature=0.0, max_tokens=remaining, ignore_eos=True)
            assert part.versions == [v1] * len(part.token_ids), f"partial versions {part.versions}, expected {v1}"
            assert rest.versions == [v2] * len(rest.token_ids), (
                f"versions after the update {rest.versions}, expected {v2}"
            )
            back = [o.token_ids for o in await greedy(backend, ps)]
            assert back == before, "restoring the original weights did not restore the original outputs"
        finally:
            _done(backend)

    _run(main)


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


def check_sleep_wake(
    make_backend: BackendFactory,
    model_dir: str | Path,
    *,
    min_release_fraction: float = 0.5,
    max_tokens: int = 12,
) -> None:
    """Outputs are identical before and after ``sleep(1)``/``wake_up()`` and
    ``sleep(2)``/``wake_up()``. On CUDA also: ``sleep(2)`` releases at least
    ``min_release_fraction`` of the device memory the backend holds (``memory_allocated``
    after building it, minus before), and ``sleep(1)`` releases some."""

    async def main():
        if _SHARED is not None:  # measure what this check's own backend holds
            _SHARED.close()
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
        backend = _build(make_backend, model_dir, fresh=True)
        on_cuda = cuda and torch.device(backend.ctx.device).type == "cuda"
        try:
            eos = _eos(backend)
            ps = _random_prompts(model_dir, 3, random.Random(10), eos)

            async def outputs():
                outs = await asyncio.gather(*(_gen(backend, p, temperature=0.0, max_tokens=max_tokens) for p in ps))
                return [o.token_ids for o in outs]

            ref = await outputs()
            for level in (1, 2):
                if on_cuda:
                    torch.cuda.synchronize()
                    held = torch.cuda.memory_allocated()
                backend.sleep(level)
                if on_cuda:
                    torch.cuda.synchronize()
                    released = held - torch.cuda.memory_allocated()
                    owned = held - base
                    if level == 1:
                        assert released > 0, "sleep(1) released no device memory"
                    else:
                        assert released >= min_release_fraction * owned, (
                            f"sleep(2) released {released / 2**20:.1f} MiB of the {owned / 2**20:.1f} MiB the "
                            f"backend holds (< {min_release_fraction:.0%})"
                        )
                backend.wake_up()
                again = await outputs()
                assert again == ref, f"outputs changed after sleep({level})/wake_up(): {again} vs {ref}"
        finally:
            _done(backend)

    _run(main)


def check_sleep_frees_device_memory(
    make_backend: BackendFactory,
    model_dir: str | Path,
    *,
    min_fraction: float | dict[int, float] = 0.5,
    max_tokens: int = 10,
) -> str:
    """CUDA only: ``sleep(1)`` and ``sleep(2)`` each give back free device memory
    (``torch.cuda.mem_get_info``) - more than none, and at least ``min_fraction`` (per level, or
    one figure for both) of what building the backend took - and greedy outputs are identical
    after each ``wake_up()``. Returns a line with the figures.

    Unlike :func:`check_sleep_wake` (``memory_allocated`` of this process), this sees memory an
    engine holds in other processes or in its own pools (SGLang's scheduler, vLLM's sleep-mode
    allocator). Not in :data:`ALL_CHECKS`: an in-process backend may rightly keep freed memory in
    PyTorch's cache for a trainer of the same process (the embedded engine's ``sleep(1)``)."""
    if not torch.cuda.is_available():
        raise AssertionError("check_sleep_frees_device_memory needs a CUDA device")
    fractions = min_fraction if isinstance(min_fraction, dict) else {1: min_fraction, 2: min_fraction}
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    backend = make_backend(model_dir)
    notes = []
    try:
        held = free_before - torch.cuda.mem_get_info()[0]
        prompts = _random_prompts(model_dir, 3, random.Random(4), _eos(backend))

        def outputs():
            async def main():
                outs = await asyncio.gather(*(_gen(backend, p, temperature=0.0, max_tokens=max_tokens) for p in prompts))
                return [o.token_ids for o in outs]

            return asyncio.run(main())

        ref = outputs()
        for level in (1, 2):
            free_awake = torch.cuda.mem_get_info()[0]
            backend.sleep(level)
            released = torch.cuda.mem_get_info()[0] - free_awake
            notes.append(f"sleep({level}) freed {released / 2**20:.0f} of {held / 2**20:.0f} MiB")
            assert released > 0 and released >= fractions.get(level, 0.0) * held, (
                f"{notes[-1]} (at least {fractions.get(level, 0.0):.0%} required)")
            backend.wake_up()
            assert outputs() == ref, f"outputs changed after sleep({level})/wake_up()"
    finally:
        backend.shutdown()
    return "; ".join(notes)


ALL_CHECKS: dict[str, Callable[..., None]] = {
    "greedy_matches_reference": check_greedy_matches_reference,
    "logprobs_match_forward": check_logprobs_match_forward,
    "stop_and_length": check_stop_and_length,
    "min_tokens": check_min_tokens,
    "seeded_sampling_batch_invariant": check_seeded_sampling_batch_invariant,
    "pause_returns_partial_and_continue": check_pause_returns_partial_and_continue,
    "weight_update": check_weight_update,
    "many_concurrent": check_many_concurrent,
    "invalid_requests_isolated": check_invalid_requests_isolated,
    "sleep_wake": check_sleep_wake,
}
"""Every check by short name (what ``run_all``'s ``skip`` and ``options`` refer to)."""


def engine_options(dtype: torch.dtype) -> dict[str, dict[str, Any]]:
    """``run_all(..., options=...)`` for a GPU inference engine computing in ``dtype`` (on the
    tiny models of :func:`make_tiny_model_dirs`), against the float32 CPU references.

    * float32: kernels differ from transformers' CPU forward in the last bits: greedy
      continuations match for 80 % of the prompts, logprobs within 2e-3.
    * bfloat16 / float16: greedy continuations may diverge anywhere; transformers itself in
      bfloat16 differs from float32 by up to 1.11 at a token and 0.13 on a response's average on
      these models (80 sampled responses of 16 tokens on four models, CPU; 1.17 and 0.15 over 256
      responses to the kit's first prompt), and its greedy token falls up to 0.89 below the
      float32 argmax (the 80 responses; ``tests/test_backend_conformance.py`` checks a subset).
      So logprobs within 1.5 per token and 0.2 on average, and a greedy token within 3.0 of the
      argmax (the engine's greedy token is its own argmax, and each of the two logprobs may be off
      by 1.5); a continuation after a pause need not repeat the uninterrupted one.
    * Either: a response may depend on what else is in the batch.
    """
    if dtype == torch.float32:
        return {"greedy_matches_reference": {"min_exact_fraction": 0.8},
                "logprobs_match_forward": {"atol": 2e-3},
                "many_concurrent": {"batch_invariant": False}}
    return {"greedy_matches_reference": {"min_exact_fraction": 0.0},
            "logprobs_match_forward": {"atol": 1.5, "mean_atol": 0.2, "argmax_atol": 3.0},
            "pause_returns_partial_and_continue": {"exact_continuation": False},
            "many_concurrent": {"batch_invariant": False}}


def run_all(
    make_backend: BackendFactory,
    model_dir: str | Path,
    other_model_dir: str | Path,
    *,
    skip: Iterable[str] = (),
    options: dict[str, dict[str, Any]] | None = None,
    reuse: bool = False,
) -> list[str]:
    """Run every check (except those named in ``skip``); ``options[name]`` are keyword
    arguments for that check. Returns the names of the checks that ran; the first failure
    raises ``AssertionError`` prefixed with the check's name. ``reuse``: checks share backends
    (:func:`reusing_backends`; for engines with a slow start-up)."""
    with reusing_backends() if reuse else contextlib.nullcontext():
        return _run_checks(make_backend, model_dir, other_model_dir, skip, options)


def _run_checks(make_backend, model_dir, other_model_dir, skip, options) -> list[str]:
    skip = set(skip)
    unknown = (skip | set(options or {})) - set(ALL_CHECKS)
    if unknown:
        raise ValueError(f"unknown check name(s) {sorted(unknown)}; known: {', '.join(ALL_CHECKS)}")
    ran = []
    for name, check in ALL_CHECKS.items():
        if name in skip:
            continue
        kwargs = dict((options or {}).get(name, {}))
        args = (make_backend, model_dir, other_model_dir) if name == "weight_update" else (make_backend, model_dir)
        try:
            check(*args, **kwargs)
        except AssertionError as exc:
            raise AssertionError(f"[{name}] {exc}") from exc
        ran.append(name)
    return ran
