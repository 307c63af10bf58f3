"""Throughput of ``benchmarks/backends.py``'s section "run": generated tokens per second through
rlcli (``backend.generate``, without and with per-request seeds, and for SGLang with
``batch_requests``) and through the engine's own offline path on the same engine object ("bare"),
in interleaved rounds; and ``--host-profile``'s profiles of the engine thread."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable

import torch

import backends_common as common
import grpo_step as gs
from backends_common import K, NotRun


def workload(seed: int = 2) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, gs.SHAPE["vocab"] - 3, (gs.PROMPT_LEN,), generator=g).tolist() for _ in range(gs.PROMPTS)]


def through_rlcli(backend, prompts: list[list[int]], seeded: bool) -> float:
    from rlcli.backends.base import GenerateRequest
    from rlcli.types import SampleParams

    params = SampleParams(max_tokens=gs.NEW, min_tokens=gs.NEW, ignore_eos=True, temperature=1.0)
    if hasattr(backend, "_use_seeds"):
        backend._use_seeds = seeded  # the runtime's switch behind the use_request_seeds option

    async def once() -> float:
        reqs = [GenerateRequest(p, params, seed=(i * K + j) if seeded else None)
                for i, p in enumerate(prompts) for j in range(K)]
        t = time.perf_counter()
        outs = await asyncio.gather(*(backend.generate(r) for r in reqs))
        dt = time.perf_counter() - t
        bad = [o for o in outs if len(o.token_ids) != gs.NEW]
        if bad:
            raise RuntimeError(f"{len(bad)} responses are not {gs.NEW} tokens: {bad[0].finish_reason} {bad[0].error}")
        return sum(len(o.token_ids) for o in outs) / dt

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(once())
    finally:
        loop.close()


def through_rlcli_batched(backend, prompts: list[list[int]]) -> float:
    """:func:`through_rlcli` without seeds, with the SGLang plugin's ``batch_requests`` on for the round."""
    was = backend.batch_requests
    backend.batch_requests = True
    try:
        return through_rlcli(backend, prompts, seeded=False)
    finally:
        backend.batch_requests = was


def bare(engine: str, backend, prompts: list[list[int]], each: bool = False) -> float:
    """Generated tok/s of the engine's own offline path on the backend's engine object (SGLang with
    ``each``: one ``generate_request`` per sequence, all in flight together)."""
    if each and engine != "sglang":
        raise ValueError(f"bare(each=True) is SGLang's diagnostic path, not {engine}'s")
    reqs = [p for p in prompts for _ in range(K)]
    if engine == "embedded":
        return bare_embedded(backend, reqs)

    counter = iter(range(10**9, 2 * 10**9))
    once = {"vllm": bare_vllm, "sglang": bare_sglang_each if each else bare_sglang, "lmdeploy": bare_lmdeploy}[engine]
    return backend._loop.call(once(backend, reqs, counter))


def bare_embedded(backend, reqs: list[list[int]]) -> float:
    """``EmbeddedEngine.step()`` until done, under the backend's lock."""
    from rlcli.backends.base import GenerateRequest
    from rlcli.types import SampleParams

    eng = backend.engine
    params = SampleParams(max_tokens=gs.NEW, min_tokens=gs.NEW, ignore_eos=True, temperature=1.0)
    t = time.perf_counter()
    with backend._lock:
        for i, p in enumerate(reqs):
            eng.submit(eng.make_sequence(GenerateRequest(p, params), i))
        n = 0
        while eng.has_work():
            n += sum(len(out.token_ids) for _, out in eng.step())
    return n / (time.perf_counter() - t)


async def bare_vllm(backend, reqs: list[list[int]], counter) -> float:
    """``LLMEngine.add_request`` + ``step()`` until done (``LLM.generate``'s loop, ``FINAL_ONLY``)."""
    eng, api = backend._engine, backend._api
    sp = api.SamplingParams(n=1, max_tokens=gs.NEW, min_tokens=gs.NEW, ignore_eos=True, temperature=1.0,
                            top_p=1.0, logprobs=0, detokenize=False,
                            output_kind=api.RequestOutputKind.FINAL_ONLY)
    t = time.perf_counter()
    for p in reqs:
        eng.add_request(f"bare-{next(counter)}", {"prompt_token_ids": p}, sp)
    n = 0
    while eng.has_unfinished_requests():
        n += sum(len(o.outputs[0].token_ids) for o in eng.step() if o.finished)
    return n / (time.perf_counter() - t)


async def bare_sglang(backend, reqs: list[list[int]], counter) -> float:
    """One batched ``generate_request`` (what ``Engine.generate(input_ids=[...])`` sends)."""
    obj = backend._api.GenerateReqInput(
        input_ids=reqs, sampling_params={"max_new_tokens": gs.NEW, "ignore_eos": True, "temperature": 1.0,
                                         "top_p": 1.0}, return_logprob=True)
    t = time.perf_counter()
    gen = backend._tm.generate_request(obj, None)
    try:
        outs = await gen.__anext__()
    finally:
        await gen.aclose()  # leaves SGLang's model-update lock (a weight update waits for it)
    dt = time.perf_counter() - t
    return sum(o["meta_info"]["completion_tokens"] for o in outs) / dt


async def bare_sglang_each(backend, reqs: list[list[int]], counter) -> float:
    """One ``generate_request`` per sequence, all in flight together (as rlcli feeds SGLang)."""
    api, tm = backend._api, backend._tm
    sampling = {"max_new_tokens": gs.NEW, "ignore_eos": True, "temperature": 1.0, "top_p": 1.0}

    async def one(p: list[int]) -> int:
        obj = api.GenerateReqInput(input_ids=p, sampling_params=dict(sampling), return_logprob=True,
                                   rid=f"bare-{next(counter)}")
        gen = tm.generate_request(obj, None)
        try:
            out = await gen.__anext__()
        finally:
            await gen.aclose()
        return out["meta_info"]["completion_tokens"]

    t = time.perf_counter()
    n = sum(await asyncio.gather(*(one(p) for p in reqs)))
    return n / (time.perf_counter() - t)


async def bare_lmdeploy(backend, reqs: list[list[int]], counter) -> float:
    """One ``EngineInstance.async_stream_infer`` stream per sequence (the pipeline without text)."""
    gc_ = backend._api.GenerationConfig(max_new_tokens=gs.NEW, min_new_tokens=gs.NEW, ignore_eos=True,
                                        do_sample=True, temperature=1.0, top_p=1.0, top_k=0, logprobs=1)

    async def one(p) -> int:
        inst = await backend._pool.get()
        try:
            n = 0
            async for out in inst.async_stream_infer(next(counter), p, gen_config=gc_):
                n += len(out.token_ids)
            return n
        finally:
            backend._pool.put_nowait(inst)

    t = time.perf_counter()
    n = sum(await asyncio.gather(*(one(p) for p in reqs)))
    return n / (time.perf_counter() - t)


# timed rounds of each path, after one warm-up round of each: seven since the eleventh device session
# (five before), as SGLang's per-round ratios then spread from 0.67 to 1.22 within one call
THROUGHPUT_ROUNDS = 7


def paired_ratio(rates: dict[str, list[float]], path: str) -> float:
    """Median over rounds of ``path``'s rate over the same round's bare rate. The lent GPU's speed
    drifts within one call (SGLang's bare rounds ran at 17.4k, 19.4k, then 26.1k tok/s), which a
    best-against-best ratio mistakes for a gap between the paths; paths of one round ran together."""
    return statistics.median(p / b for p, b in zip(rates[path], rates["bare"]))


def throughput_paths(engine: str, backend, prompts: list[list[int]]) -> dict[str, Callable[[], float]]:
    """One round of each measured path, by name: through rlcli without and with per-request seeds
    ("plain", "seeded"), the engine's own offline path ("bare"), and for SGLang "bare_each" and
    "batched" (through rlcli with ``batch_requests``)."""
    paths = {
        "plain": lambda: through_rlcli(backend, prompts, seeded=False),
        "seeded": lambda: through_rlcli(backend, prompts, seeded=engine != "embedded"),
        "bare": lambda: bare(engine, backend, prompts),
    }
    if engine == "sglang":
        # Diagnostic: the bare engine fed one request per call, as rlcli feeds it, instead of one
        # batched call. Near "plain": the gap is SGLang's per-request path; near "bare": it is rlcli's.
        paths["bare_each"] = lambda: bare(engine, backend, prompts, each=True)
        paths["batched"] = lambda: through_rlcli_batched(backend, prompts)
    return paths


def throughput(engine: str, backend, prompts: list[list[int]]) -> dict[str, list[float]]:
    """Generated tok/s of the paths of :func:`throughput_paths` (those of ``--paths`` when given;
    "bare" always), in interleaved rounds (a warm-up round of each first; ``--rounds`` timed rounds,
    default ``THROUGHPUT_ROUNDS``), so that compilation, cache warm-up or clock drift during the run
    does not favour one of them; each round starts one path later (:func:`round_order`), so that no
    path always follows the same one."""
    paths = throughput_paths(engine, backend, prompts)
    if common.PATHS:
        unknown = set(common.PATHS) - set(paths)
        if unknown:
            raise ValueError(f"--paths: {engine} has no path {sorted(unknown)}; its paths: {', '.join(paths)}")
        paths = {k: v for k, v in paths.items() if k in common.PATHS or k == "bare"}
    rates: dict[str, list[float]] = {k: [] for k in paths}
    for i in range(1 + (common.ROUNDS or THROUGHPUT_ROUNDS)):
        for k in round_order(list(paths), i):
            rates[k].append(paths[k]())
    return {k: v[1:] for k, v in rates.items()}


def round_order(names: list[str], i: int) -> list[str]:
    """The paths of round ``i`` (0 the warm-up) in the order they run: ``names`` rotated by ``i``."""
    k = i % len(names)
    return names[k:] + names[:k]


def host_profile(engine: str, backend, prompts: list[list[int]], top: int = 30) -> dict[str, str]:
    """One plain round through rlcli and one bare round, each under ``cProfile`` enabled on the
    engine thread (where the engine, its event loop and the plugin's stream handling run; Python
    3.12's profiler also sees the other threads), with the functions that took the most time of
    their own. Says where the host time of the rlcli path goes that the bare path does not spend."""
    import cProfile
    import io
    import pstats

    loop = getattr(backend, "_loop", None)
    if loop is None:
        raise NotRun("not an engine plugin: no engine thread to profile")
    paths = throughput_paths(engine, backend, prompts)
    texts = {}
    for name in ("plain", "bare"):
        run = paths[name]
        prof = cProfile.Profile()

        async def switch(on: bool) -> None:
            prof.enable() if on else prof.disable()

        loop.call(switch(True))
        try:
            rate = run()
        finally:
            loop.call(switch(False))
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
        texts[name] = f"# {engine}, {name} path: {rate:,.0f} tok/s under the profiler\n{buf.getvalue()}"
    return texts
