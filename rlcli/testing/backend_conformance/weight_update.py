"""The weight-update check: ``update_weights`` between generations and in the middle of one."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import torch

from rlcli.testing.backend_conformance.helpers import BackendFactory, _eos, _gen, _random_prompts
from rlcli.testing.backend_conformance.sharing import _build, _done, _run


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
                _check_unknown_names_rejected(backend, v1)

            # mid-generation: pause, update back to the original weights, resume, continue
            await _check_update_mid_generation(backend, ps[0], v1, mine_sd, max_tokens)
            back = [o.token_ids for o in await greedy(backend, ps)]
            assert back == before, "restoring the original weights did not restore the original outputs"
        finally:
            _done(backend)

    _run(main)


def _check_unknown_names_rejected(backend, v1: int) -> None:
    """``update_weights`` with unknown names raises ``ValueError`` naming them and keeps the version."""
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


async def _check_update_mid_generation(backend, p: list[int], v1: int, mine_sd, max_tokens: int) -> None:
    """Pause a greedy request on ``p`` mid-generation, update to ``mine_sd`` (version ``v1 + 1``),
    resume and continue it: the partial tokens carry ``v1``, the continuation ``v1 + 1``."""
    long_tokens = 4 * max_tokens
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
