"""Pause/abort/continue and sleep/wake checks."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import torch

from rlcli.testing.backend_conformance import sharing
from rlcli.testing.backend_conformance.helpers import BackendFactory, _check_shape, _eos, _gen, _random_prompts
from rlcli.testing.backend_conformance.sharing import _build, _done, _run


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
        if sharing._SHARED is not None:  # measure what this check's own backend holds
            sharing._SHARED.close()
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
