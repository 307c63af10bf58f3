"""``benchmarks/backends.py``'s section "copies" (a diagnostic, run only when named): why greedy
copies of one prompt differ in the kit's ``many_concurrent``, for each ``--kit-variant`` of the
kit engine's settings."""

from __future__ import annotations

import asyncio
import gc
import time
import traceback
from pathlib import Path

import backends_common as common
from backends_common import result, time_left
from backends_conformance import conformance_setup, kit_models


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``"name:a.b=1,c=true"`` -> ``("name", ["a.b=1", "c=true"])``; ``"base:"`` has no settings."""
    name, sep, rest = text.partition(":")
    sets = [x.strip() for x in rest.split(",") if x.strip()]
    if not sep or not name.strip() or any("=" not in x for x in sets):
        raise ValueError(f"--kit-variant {text!r}: expected NAME:KEY=VALUE[,KEY=VALUE...] (or NAME: for none)")
    return name.strip(), sets


def copies_summary(prompts: list[list[int]], outputs: dict[tuple, list[list[int]]]) -> dict:
    """How far the greedy copies of each prompt agree: prompts whose copies differ, the most
    distinct outputs one prompt had, the earliest position where two copies part, and one example."""
    diverging, most, first, example = 0, 1, None, None
    for p in prompts:
        outs = outputs[tuple(p)]
        distinct = {tuple(o) for o in outs}
        most = max(most, len(distinct))
        if len(distinct) > 1:
            diverging += 1
            a = outs[0]
            for b in (o for o in outs if o != a):
                pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                first = pos if first is None else min(first, pos)
                example = example or {"prompt": p, "a": a, "b": b}
    return {"prompts": len(prompts), "diverging": diverging, "most_distinct": most,
            "earliest_divergence": first, "example": example}


def section_copies(engine: str, root: Path) -> None:
    """Why greedy copies of one prompt differ in ``many_concurrent`` (a diagnostic). For each
    ``--kit-variant`` (default: the kit's settings alone), one kit engine on the tiny model, then:

    * ``mixed``: ``many_concurrent``'s whole load (320 concurrent requests, 10 greedy prompts x 8
      copies among sampled ones), the greedy copies compared per prompt;
    * ``alone``: each greedy prompt's 8 copies sent concurrently with nothing else;
    * ``serial``: each greedy prompt sent 8 times, one request at a time.

    Copies that differ only under ``mixed`` depend on the batch around them; a variant whose copies
    agree names the cause it removes (e.g. SGLang's ``enable_deterministic_inference``, its
    batch-invariant kernels)."""
    device, a, _ = kit_models(root / "kit-copies")
    for name, sets in common.KIT_VARIANTS or [("kit", [])]:
        if time_left() < 90:
            result(what="copies", engine=engine, variant=name, settings=sets, error="not run: time budget")
            continue
        copies_variant(engine, device, a, name, sets)


def copies_variant(engine: str, device: str, model_dir: Path, name: str, sets: list[str]) -> None:
    """One ``--kit-variant``: its kit engine built, the three loads run, one ``copies`` result."""
    t0 = time.perf_counter()
    backend = None
    try:
        make_backend, _, _ = conformance_setup(engine, device, sets)
        backend = make_backend(model_dir)
        build_s = time.perf_counter() - t0
        summary = asyncio.run(greedy_copies(backend, model_dir))
        result(what="copies", engine=engine, variant=name, settings=sets, build_s=round(build_s, 1),
               seconds=round(time.perf_counter() - t0, 1), **summary)
    except Exception:
        result(what="copies", engine=engine, variant=name, settings=sets, error=traceback.format_exc()[-2000:])
    finally:
        if backend is not None:
            try:
                backend.shutdown()
            except Exception:
                result(what="copies_shutdown", engine=engine, variant=name, error=traceback.format_exc()[-1000:])
        gc.collect()


async def greedy_copies(backend, model_dir: Path) -> dict:
    """The greedy copies of ``many_concurrent``'s prompts under its whole load (``mixed``), sent
    together alone (``alone``) and one at a time (``serial``), each summarised by :func:`copies_summary`."""
    from rlcli.backends.base import GenerateRequest
    from rlcli.testing import backend_conformance as bc
    from rlcli.types import SampleParams

    eos = list(backend.ctx.eos_token_ids or [])
    ps, jobs = bc.many_concurrent_jobs(model_dir, eos)
    greedy = [p for i, p in enumerate(ps) if i % 4 == 0]
    repeat = sum(1 for p, kw in jobs if p is greedy[0])
    params = [SampleParams(**kw) for _, kw in jobs]
    outs = await asyncio.gather(*(backend.generate(GenerateRequest(list(p), sp))
                                  for (p, _), sp in zip(jobs, params)))
    mixed: dict[tuple, list[list[int]]] = {}
    for (p, kw), o in zip(jobs, outs):
        if kw["temperature"] == 0.0:
            mixed.setdefault(tuple(p), []).append(list(o.token_ids))
    max_tokens = next(kw["max_tokens"] for _, kw in jobs if kw["temperature"] == 0.0)
    greedy_sp = SampleParams(temperature=0.0, max_tokens=max_tokens)
    alone: dict[tuple, list[list[int]]] = {}
    serial: dict[tuple, list[list[int]]] = {}
    for p in greedy:
        got = await asyncio.gather(*(backend.generate(GenerateRequest(list(p), greedy_sp))
                                     for _ in range(repeat)))
        alone[tuple(p)] = [list(o.token_ids) for o in got]
        serial[tuple(p)] = [list((await backend.generate(GenerateRequest(list(p), greedy_sp))).token_ids)
                            for _ in range(repeat)]
    # does the mixed load's first copy match the prompt served alone?
    solo_differs = sum(mixed[tuple(p)][0] != serial[tuple(p)][0] for p in greedy)
    return {"mixed": copies_summary(greedy, mixed), "alone": copies_summary(greedy, alone),
            "serial": copies_summary(greedy, serial), "mixed_first_copy_vs_serial_differs": solo_differs}
