"""Inference engines behind rlcli on one GPU: conformance kit, a 3-step GRPO run, and throughput
through rlcli against the same engine driven bare.

    python benchmarks/backends.py --engine vllm --out results/backends      # GPU machine with vLLM
    python benchmarks/backends.py --engine sglang --out results/backends
    python benchmarks/backends.py --engine lmdeploy --out results/backends
    python benchmarks/backends.py --engine embedded --tiny                   # CPU: checks the script, measures nothing

Sections (``--sections run,conformance`` by default; each failure is recorded and the rest runs):

run
    The Qwen2.5-0.5B-shaped random model, tokenizer and prompts of ``benchmarks/grpo_step.py``;
    ``ColocateRunner`` builds the trainer and the backend (``rollout.name=<engine>``) as
    ``rlcli train`` would. Before training, with the trainer already on the GPU:

    * **throughput through rlcli**: 64 prompts x 8 copies = 512 concurrent ``backend.generate``
      calls (as the agent loop sends them), 256 forced new tokens each (``ignore_eos``,
      ``min_tokens``), temperature 1, in generated tokens per second; once without and once with
      per-request seeds;
    * **bare**: the same engine object, same prompts and sampling, driven through the engine's own
      offline path on the plugin's engine thread - vLLM: ``LLMEngine.add_request`` + ``step()``
      until done (``LLM.generate``'s loop, ``FINAL_ONLY`` outputs); SGLang: one batched
      ``generate_request`` (what ``Engine.generate(input_ids=[...])`` sends); LMDeploy: one
      ``EngineInstance.async_stream_infer`` stream per prompt (the pipeline without text);
      embedded: ``EmbeddedEngine.step()`` until done.
    * **bare_each** (SGLang only, a diagnostic): the bare engine fed one ``generate_request`` per
      sequence, as rlcli feeds it.
    * **batched** (SGLang only): through rlcli as above (no seeds), with the plugin's
      ``batch_requests`` switched on for the round (``backend.batch_requests``): the 512 calls go
      to SGLang as one batched ``generate_request``, as in bare.

    The paths run in interleaved rounds: one warm-up round of each, then five timed rounds of
    each. Reported: the best round of each path and its ratio to the best bare round, and the
    median over rounds of each round's ratio to that round's bare rate, for plain, seeded and
    batched (all rounds are in the JSON).

    Then three GRPO steps (``runner.fit()``: rollout, sleep, train, weight sync, wake up), the
    recipe of ``grpo_step.py`` (reward = response length mod 7, lr 1e-6).
conformance
    Every check of ``rlcli.testing.backend_conformance`` on two tiny qwen2 models (hidden 256,
    head dim 64, as engines' attention kernels want), with the engine's tolerances, each check
    recorded as pass / FAIL (message) / not run; then the plugin checks of the same properties
    the kit cannot see for an engine: logprobs against the forward pass in the range the engine's
    logprob mode is exact, and free device memory after ``sleep(1)``/``sleep(2)``
    (``torch.cuda.mem_get_info``: the kit reads ``memory_allocated``, blind to vLLM's sleep-mode
    pool and to SGLang's scheduler process).

copies (a diagnostic, only when named)
    Why greedy copies of one prompt differ in the kit's ``many_concurrent``: for each
    ``--kit-variant NAME:KEY=VALUE,...`` one kit engine, whose greedy copies are compared inside the
    check's whole load, sent together alone, and sent one at a time (``section_copies``).

Output: ``RESULT {json}`` lines; with ``--out DIR``: ``results-<engine>.json`` and
``backends-<engine>.md`` (rows for docs/backends.md). ``--deadline-s`` (default 540) stops
starting new work when the device call's 600 s limit comes close; what did not run says so.

On the project's offline H200 (no network; read ../shared/tools/README.md first). Here, build the
carry folders of the engine plus what the device lacks for rlcli itself (pydantic):

    ../shared/tools/wheelhouse --exclude pynvvideocodec vllm==0.26.0 pydantic      # 17 chunks for vLLM
    ../shared/tools/wheelhouse --exclude pynvvideocodec sglang==0.5.17 pydantic    # 21 chunks
    ../shared/tools/wheelhouse --exclude pynvvideocodec --split-mb 54.5 lmdeploy==0.18.0 pydantic  # 25 chunks

then, on the device, one call per chunk back to back (the machine and its /tmp are given back
~30 s after a call): ``carry [".carry/wh-NN"]``, command ``mkdir -p /tmp/wh && cp .carry/wh-NN/*
/tmp/wh/``; and finally, in one call of at most 600 s:

    bash /tmp/wh/INSTALL.sh && export PYTHONPATH=/tmp/site:$PYTHONPATH PATH=/tmp/site/bin:$PATH && \\
        python benchmarks/backends.py --engine vllm --out $OUT

Neither rlcli nor the plugin needs installing there: this script puts the repository and
``plugins/rlcli-<engine>`` on ``sys.path`` and registers the plugin in the recipe's registry
itself. If one call cannot hold everything, run ``--sections run`` and ``--sections conformance``
in two calls.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import importlib
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
for _plugin in ("rlcli-vllm", "rlcli-sglang", "rlcli-lmdeploy"):
    sys.path.insert(0, str(REPO / "plugins" / _plugin))

import grpo_step as gs  # noqa: E402  (model, tokenizer, prompts and recipe of the GRPO benchmark)

ENGINES = ("embedded", "vllm", "sglang", "lmdeploy")
PLUGIN_MODULES = {"vllm": "rlcli_vllm", "sglang": "rlcli_sglang", "lmdeploy": "rlcli_lmdeploy"}
K = gs.K  # copies of each prompt
GRPO_STEPS = 3
RESULTS: list[dict] = []
START = time.monotonic()
DEADLINE_S = 540.0


def result(**kw) -> dict:
    RESULTS.append(kw)
    print("RESULT " + json.dumps(kw, default=str), flush=True)
    return kw


def time_left() -> float:
    return DEADLINE_S - (time.monotonic() - START)


def engine_version(engine: str) -> str:
    if engine == "embedded":
        import rlcli

        return f"rlcli {rlcli.__version__}"
    import importlib.metadata as md

    try:
        return f"{engine} {md.version(engine)}"
    except md.PackageNotFoundError:
        return f"{engine} (not installed)"


# ------------------------------------------------------------------------------------------
# Engine settings: the big run (0.5B model next to its trainer) and the tiny conformance models
# ------------------------------------------------------------------------------------------
def run_rollout_config(engine: str, sequences: int) -> dict[str, Any]:
    common = {"max_model_len": 512, "max_batch_size": sequences}
    return {
        "embedded": {"name": "embedded", **common},
        "vllm": {"name": "vllm", "gpu_memory_utilization": 0.35, **common},
        "sglang": {"name": "sglang", "mem_fraction_static": 0.35, **common},
        "lmdeploy": {"name": "lmdeploy", "cache_max_entry_count": 0.35, **common},
    }[engine]


def kit_settings(settings: dict, extra: Sequence[str] = ()) -> dict:
    """The kit engines' backend settings with ``--kit-set`` (then ``extra``) applied on top."""
    from rlcli.overrides import apply_overrides

    return apply_overrides(settings, [*KIT_SET, *extra])


def conformance_setup(engine: str, device: str, extra: Sequence[str] = ()) -> tuple[Callable, dict, torch.dtype]:
    """``(make_backend, kit options, dtype)`` for the tiny conformance models (``extra``: more
    ``KEY=VALUE`` settings on top of ``--kit-set``)."""
    from rlcli.testing import backend_conformance as bc

    if engine == "embedded":
        from rlcli.backends.embedded import EmbeddedBackend

        dtype = torch.float32
        cfg = EmbeddedBackend.Config(**kit_settings({"max_batch_size": 64}, extra))
        return (lambda d: EmbeddedBackend(cfg, bc.default_context(d, device=device, dtype=dtype))), {}, dtype
    mod = importlib.import_module(PLUGIN_MODULES[engine])
    if engine == "vllm":
        cls, dtype = mod.VLLMBackend, torch.float32
        settings = dict(gpu_memory_utilization=0.25, enforce_eager=True, max_model_len=512)
    elif engine == "sglang":
        # bf16: SGLang 0.5.17's fused RMSNorm (sgl-kernel) has no float32 path; the plugin refuses float32
        cls, dtype = mod.SGLangBackend, torch.bfloat16
        # Each kit engine took 47-120 s to build on the H200, capturing graphs for 58 prefill token counts
        # and 36 decode batch sizes up to 256; the tiny models need none of that (same semantics).
        settings = dict(mem_fraction_static=0.25, max_model_len=512,
                        engine_kwargs=dict(disable_prefill_cuda_graph=True, cuda_graph_max_bs_decode=32))
    else:
        cls, dtype = mod.LMDeployBackend, torch.bfloat16
        settings = dict(cache_max_entry_count=0.25, max_model_len=512, max_batch_size=256)
    cfg = cls.Config(**kit_settings(settings, extra))
    return (lambda d: cls(cfg, bc.default_context(d, device=device, dtype=dtype))), bc.engine_options(dtype), dtype


# Kit checks each engine fails by design, with the reason (reported next to the result).
BY_DESIGN = {
    "vllm": {"logprobs_match_forward": "vLLM renormalises over top-k/top-p in processed_logprobs mode",
             "sleep_wake": "memory_allocated() does not see vLLM's sleep-mode memory pool"},
    "sglang": {"sleep_wake": "memory_allocated() does not see SGLang's scheduler process",
               "seeded_sampling_batch_invariant": "request seeds are off by default (flashinfer sampling)",
               "many_concurrent": "without use_request_seeds (deterministic mode), SGLang's kernels depend on the "
                                  "batch: greedy copies can part at a near tie (--sections copies)"},
    "lmdeploy": {"logprobs_match_forward": "LMDeploy returns temperature-1 logprobs",
                 "sleep_wake": "memory_allocated() does not see memory freed by LMDeploy's offload"},
}


# ------------------------------------------------------------------------------------------
# Throughput: through rlcli and bare, on the same engine object
# ------------------------------------------------------------------------------------------
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
        from rlcli.backends.base import GenerateRequest
        from rlcli.types import SampleParams

        eng = backend.engine
        params = SampleParams(max_tokens=gs.NEW, min_tokens=gs.NEW, ignore_eos=True, temperature=1.0)

        def once() -> float:
            t = time.perf_counter()
            with backend._lock:
                for i, p in enumerate(reqs):
                    eng.submit(eng.make_sequence(GenerateRequest(p, params), i))
                n = 0
                while eng.has_work():
                    n += sum(len(out.token_ids) for _, out in eng.step())
            return n / (time.perf_counter() - t)

        return once()

    counter = iter(range(10**9, 2 * 10**9))

    async def vllm_once() -> float:
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

    async def sglang_once() -> float:
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

    async def sglang_each_once() -> float:
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

    async def lmdeploy_once() -> float:
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

    once = {"vllm": vllm_once, "sglang": sglang_each_once if each else sglang_once, "lmdeploy": lmdeploy_once}[engine]
    return backend._loop.call(once())


THROUGHPUT_ROUNDS = 5  # timed rounds of each path, after one warm-up round of each


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
    """Generated tok/s of the paths of :func:`throughput_paths`, in interleaved rounds (a warm-up
    round of each first), so that compilation, cache warm-up or clock drift during the run does not
    favour one of them."""
    paths = throughput_paths(engine, backend, prompts)
    rates: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(1 + THROUGHPUT_ROUNDS):
        for k, f in paths.items():
            rates[k].append(f())
    return {k: v[1:] for k, v in rates.items()}


HOST_PROFILE: Path | None = None  # --host-profile: write the engine thread's profiles here


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


# ------------------------------------------------------------------------------------------
# Section "run": throughput, then 3 GRPO steps through ColocateRunner
# ------------------------------------------------------------------------------------------
def section_run(engine: str, root: Path) -> None:
    from rlcli.config import validate_recipe
    from rlcli.plugins import registry_with
    from rlcli.runner.colocate import ColocateRunner

    registry = registry_with(gs.bench_plugin)
    if engine not in registry.names("inference_backend"):  # the plugin is not pip-installed: register it here
        registry = registry_with(gs.bench_plugin, importlib.import_module(PLUGIN_MODULES[engine]))
    model_dir = gs.make_model_dir((root / "model").resolve()) if not (root / "model" / "config.json").exists() \
        else root / "model"
    data = gs.write_prompts(root / "prompts.jsonl", gs.PROMPTS * (GRPO_STEPS + 2))
    raw = gs.bench_recipe(model_dir, data, root / f"work-{engine}", GRPO_STEPS,
                          rollout=run_rollout_config(engine, gs.PROMPTS * K))
    rec = validate_recipe(raw, registry=registry)
    t0 = time.perf_counter()
    runner = ColocateRunner(rec, quiet=True, overwrite=True)
    startup = time.perf_counter() - t0
    result(what="startup", engine=engine, seconds=round(startup, 1))
    rows: list[dict] = []
    try:
        prompts = workload()
        try:
            rates = throughput(engine, runner.backend, prompts)
            plain, seeded, bare_rate = (max(rates[k]) for k in ("plain", "seeded", "bare"))
            result(what="throughput", engine=engine, sequences=len(prompts) * K, new_tokens=gs.NEW,
                   rlcli_tok_s=round(plain), rlcli_seeded_tok_s=round(seeded), bare_tok_s=round(bare_rate),
                   ratio=round(plain / bare_rate, 3), seeded_ratio=round(seeded / bare_rate, 3),
                   ratio_paired_median=round(paired_ratio(rates, "plain"), 3),
                   seeded_ratio_paired_median=round(paired_ratio(rates, "seeded"), 3),
                   **({"bare_each_tok_s": round(max(rates["bare_each"]))} if "bare_each" in rates else {}),
                   **({"batched_tok_s": round(max(rates["batched"])),
                       "batched_ratio": round(max(rates["batched"]) / bare_rate, 3),
                       "batched_ratio_paired_median": round(paired_ratio(rates, "batched"), 3)}
                      if "batched" in rates else {}),
                   rounds={k: [round(r) for r in v] for k, v in rates.items()})
        except Exception:
            result(what="throughput", engine=engine, error=traceback.format_exc()[-2000:])
        if HOST_PROFILE is not None:
            try:
                texts = host_profile(engine, runner.backend, prompts)
                HOST_PROFILE.mkdir(parents=True, exist_ok=True)
                for name, text in texts.items():
                    (HOST_PROFILE / f"host-profile-{engine}-{name}.txt").write_text(text)
                result(what="host_profile", engine=engine,
                       rates={k: v.splitlines()[0] for k, v in texts.items()}, dir=str(HOST_PROFILE))
            except NotRun as exc:
                result(what="host_profile", engine=engine, error=f"not run: {exc}")
            except Exception:
                result(what="host_profile", engine=engine, error=traceback.format_exc()[-2000:])
        if hasattr(runner.backend, "_use_seeds"):
            runner.backend._use_seeds = bool(getattr(runner.backend.config, "use_request_seeds", True))
        runner.backend.stats()  # reset the counters: the GRPO rows count their own tokens
        orig_log = runner.log

        def log(step, metrics, groups=None):
            out = orig_log(step, metrics, groups)
            rows.append(out)
            return out

        runner.log = log
        runner.fit()
    finally:
        runner.close()
        del runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    steps = [r["timing/step_s"] for r in rows]
    losses = [r.get("train/loss", r.get("loss/policy", float("nan"))) for r in rows]
    result(what="grpo", engine=engine, steps=len(rows), step_s=[round(s, 2) for s in steps],
           step_s_median_after_first=round(statistics.median(steps[1:]), 2) if len(steps) > 1 else None,
           rollout_s=[round(r["timing/rollout_s"], 2) for r in rows],
           train_s=[round(r["timing/train_s"], 2) for r in rows],
           sync_s=[round(r["timing/sync_s"], 3) for r in rows],
           reward_mean=[round(r.get("reward/mean", float("nan")), 3) for r in rows],
           rollout_logprob_diff=[r.get("train/rollout_logprob_diff") for r in rows],
           finite=all(math.isfinite(x) for x in losses if isinstance(x, float)) and len(rows) == GRPO_STEPS)


# ------------------------------------------------------------------------------------------
# Section "conformance"
# ------------------------------------------------------------------------------------------
def exact_range_logprobs(engine: str, make_backend, model_dir, dtype: torch.dtype) -> None:
    """Logprobs against the forward pass where the engine's logprob mode is exact."""
    from rlcli.testing import backend_conformance as bc

    settings = {"vllm": [dict(temperature=t) for t in (1.0, 0.7, 0.0)],
                "lmdeploy": [dict(temperature=1.0), dict(temperature=1.0, top_k=5, top_p=0.9), dict(temperature=0.0)]}
    settings = settings.get(engine, [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9)])
    bc.check_logprobs_match_forward(make_backend, model_dir, settings=settings, max_tokens=12,
                                    **bc.engine_options(dtype)["logprobs_match_forward"])


class NotRun(Exception):
    """A plugin check that cannot run here (the reason is the message)."""


def sleep_releases_memory(make_backend, model_dir) -> str:
    """Free device memory after sleep(1)/sleep(2) and identical greedy outputs after wake_up."""
    from rlcli.testing import backend_conformance as bc

    if not torch.cuda.is_available():
        raise NotRun("no CUDA device: device memory cannot be measured")
    return bc.check_sleep_frees_device_memory(make_backend, model_dir, min_fraction=0.0)


CHECKS: list[str] = []  # --checks: the conformance checks to run; empty: all
KIT_SET: list[str] = []  # --kit-set: KEY=VALUE settings of the kit engines' backend config


def kit_models(where: Path) -> tuple[str, Path, Path]:
    """``(device, model dir, other model dir)``: the kit's two tiny qwen2 models, on the GPU with
    hidden 256 and head dim 64 (as engines' attention kernels want)."""
    from rlcli.testing import backend_conformance as bc

    device = "cuda" if gs.DEVICE == "cuda" else "cpu"
    spec = {} if device != "cuda" else dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                            intermediate_size=512)
    a, b = bc.make_tiny_model_dirs(where, arch="qwen2", **spec)
    return device, a, b


def section_conformance(engine: str, root: Path) -> None:
    from rlcli.testing import backend_conformance as bc

    device, a, b = kit_models(root / "kit")
    make_backend, options, dtype = conformance_setup(engine, device)
    by_design = BY_DESIGN.get(engine, {})

    def run_check(name: str, fn: Callable[[], str | None]) -> None:
        if CHECKS and name not in CHECKS:
            return
        if time_left() < 30:
            result(what="check", engine=engine, check=name, status="not run", detail="time budget of the device call")
            return
        t = time.perf_counter()
        try:
            status, detail = "pass", fn() or ""
        except NotRun as exc:
            status, detail = "not run", str(exc)
        except Exception as exc:  # AssertionError or an engine failure: recorded, the rest runs
            status, detail = "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        result(what="check", engine=engine, check=name, status=status, detail=detail,
               by_design=by_design.get(name, ""), seconds=round(time.perf_counter() - t, 1), dtype=str(dtype))

    # The kit's checks, and the plugin check of logprobs in their exact range just before sleep_wake
    # (which builds an engine of its own). Consecutive checks share one engine (a failing check's
    # engine is replaced): about 4 engine start-ups for the whole kit instead of one per check. The
    # free-memory check comes last, outside the sharing: it needs the only engine in the process.
    plan: list[tuple[str, Callable[[], str | None]]] = []
    for name, check in bc.ALL_CHECKS.items():
        if name == "sleep_wake" and engine != "embedded":
            plan.append(("logprobs_in_exact_range", lambda: exact_range_logprobs(engine, make_backend, a, dtype)))
        args = (make_backend, a, b) if name == "weight_update" else (make_backend, a)
        plan.append((name, functools.partial(check, *args, **options.get(name, {}))))
    with bc.reusing_backends() as shared:
        for name, fn in plan:
            run_check(name, fn)
    result(what="conformance_engines_built", engine=engine, count=shared.built)
    run_check("sleep_releases_device_memory", lambda: sleep_releases_memory(make_backend, a))


KIT_VARIANTS: list[tuple[str, list[str]]] = []  # --kit-variant NAME:KEY=VALUE,...: the copies section's engines


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
    from rlcli.backends.base import GenerateRequest
    from rlcli.testing import backend_conformance as bc
    from rlcli.types import SampleParams

    device, a, _ = kit_models(root / "kit-copies")
    for name, sets in KIT_VARIANTS or [("kit", [])]:
        if time_left() < 90:
            result(what="copies", engine=engine, variant=name, settings=sets, error="not run: time budget")
            continue
        t0 = time.perf_counter()
        backend = None
        try:
            make_backend, _, _ = conformance_setup(engine, device, sets)
            backend = make_backend(a)
            build_s = time.perf_counter() - t0

            async def go(backend=backend):
                eos = list(backend.ctx.eos_token_ids or [])
                ps, jobs = bc.many_concurrent_jobs(a, eos)
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

            summary = asyncio.run(go())
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


# ------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------
def markdown(engine: str, env: dict) -> str:
    by = {}
    for r in RESULTS:
        by.setdefault(r["what"], []).append(r)
    checks = by.get("check", [])
    passed = sum(r["status"] == "pass" for r in checks)
    failed = [r["check"] for r in checks if r["status"] == "FAIL"]
    not_run = [r["check"] for r in checks if r["status"] == "not run"]
    conf = f"{passed}/{len(checks)} pass" if checks else "not run"
    if failed:
        conf += f"; FAIL: {', '.join(failed)}"
    if not_run:
        conf += f"; not run: {', '.join(not_run)}"
    grpo = (by.get("grpo") or [{}])[-1]
    if "steps" in grpo:
        grpo_cell = (f"{grpo['steps']}/{GRPO_STEPS} steps, {'finite' if grpo.get('finite') else 'NOT finite'}, "
                     f"step s {grpo['step_s']}, rollout-vs-train logprob diff "
                     f"{[f'{x:.2g}' for x in grpo.get('rollout_logprob_diff') or [] if x is not None]}")
    else:
        grpo_cell = "not run" if "grpo" not in by else f"error: {str(grpo.get('error', ''))[:120]}"
    thr = (by.get("throughput") or [{}])[-1]
    if "rlcli_tok_s" in thr:
        paired = f" (per-round median {thr['ratio_paired_median']:.2f})" if "ratio_paired_median" in thr else ""
        tput = (f"{thr['rlcli_tok_s']:,} | {thr['rlcli_seeded_tok_s']:,} | {thr['bare_tok_s']:,} | "
                f"{thr['ratio']:.2f}{paired}")
    else:
        tput = "not run | - | - | -" if "throughput" not in by else "error | - | - | -"
    lines = [
        f"<!-- benchmarks/backends.py --engine {engine}: {env['date']}, {env['device']}, torch {env['torch']}, "
        f"rlcli {env['commit']} -->",
        "| engine | date | device | conformance | 3-step GRPO | tok/s via rlcli | via rlcli, seeded | bare engine | "
        "rlcli / bare |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {env['engine_version']} | {env['date']} | {env['device']} | {conf} | {grpo_cell} | {tput} |",
        "",
    ]
    if "batched_tok_s" in thr:
        lines += [f"Via rlcli with `batch_requests: true`: {thr['batched_tok_s']:,} tok/s, "
                  f"{thr['batched_ratio']:.2f} of bare (per-round median {thr['batched_ratio_paired_median']:.2f}).",
                  ""]
    lines += [
        "| check | result | detail | by design |",
        "| --- | --- | --- | --- |",
    ]
    for r in checks:
        lines.append(f"| {r['check']} | {r['status']} | {r.get('detail', '').replace('|', '/')} | "
                     f"{r.get('by_design', '')} |")
    if by.get("copies"):
        lines += ["", "Greedy copies (prompts whose copies differ / greedy prompts; most distinct outputs of one "
                  "prompt; earliest position two copies part):", "", "| variant | settings | mixed load | copies alone | one at a time | build s |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in by["copies"]:
            if "error" in r:
                lines.append(f"| {r['variant']} | {', '.join(r['settings'])} | error: "
                             f"{str(r['error']).strip().splitlines()[-1][:150].replace('|', '/')} | | | |")
                continue
            cell = [f"{r[k]['diverging']} / {r[k]['prompts']}, {r[k]['most_distinct']}, "
                    f"{r[k]['earliest_divergence']}" for k in ("mixed", "alone", "serial")]
            lines.append(f"| {r['variant']} | {', '.join(r['settings'])} | {' | '.join(cell)} | {r['build_s']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    global DEADLINE_S, HOST_PROFILE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=ENGINES, required=True)
    ap.add_argument("--sections", default="run,conformance",
                    help="comma-separated: run, conformance, copies (a diagnostic, not run by default)")
    ap.add_argument("--out", type=Path, help="write results-<engine>.json and backends-<engine>.md here")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks the script, measures nothing")
    ap.add_argument("--host-profile", action="store_true",
                    help="after the throughput rounds, profile one plain and one bare round on the engine thread "
                         "(host-profile-<engine>-{plain,bare}.txt in --out)")
    ap.add_argument("--checks", default="", help="comma-separated conformance checks to run (default: all)")
    ap.add_argument("--kit-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a backend setting of the conformance kit's engines, on top of the script's (repeatable; "
                         "dotted keys, YAML values), e.g. engine_kwargs.disable_radix_cache=true")
    ap.add_argument("--kit-variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                    help="for --sections copies: one kit engine per variant, with these settings on top of "
                         "--kit-set (repeatable; 'NAME:' for none), e.g. no_radix:engine_kwargs.disable_radix_cache=true")
    ap.add_argument("--deadline-s", type=float, default=540.0, help="start no new work after this many seconds")
    args = ap.parse_args()
    DEADLINE_S = args.deadline_s
    CHECKS[:] = [c.strip() for c in args.checks.split(",") if c.strip()]
    KIT_SET[:] = args.kit_set
    try:
        KIT_VARIANTS[:] = [parse_variant(v) for v in args.kit_variant]
    except ValueError as exc:
        ap.error(str(exc))
    HOST_PROFILE = (args.out or Path(".")) if args.host_profile else None
    from rlcli.testing import backend_conformance as bc

    known = [*bc.ALL_CHECKS, "logprobs_in_exact_range", "sleep_releases_device_memory"]
    if set(CHECKS) - set(known):
        ap.error(f"--checks: unknown {sorted(set(CHECKS) - set(known))}; known: {', '.join(known)}")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - {"run", "conformance", "copies"}
    if unknown:
        ap.error(f"unknown section(s): {', '.join(sorted(unknown))}")
    if args.tiny:
        gs.SHAPE.update(gs.SHAPES["tiny"])
        gs.DEVICE, gs.PROMPTS, gs.NEW, gs.PROMPT_LEN = "cpu", 4, 8, 8
    elif not torch.cuda.is_available():
        ap.error("no CUDA device: use --tiny on a CPU machine")
    gs.DTYPE = torch.bfloat16 if gs.DEVICE == "cuda" else torch.float32
    if args.engine != "embedded":
        problem = importlib.import_module(PLUGIN_MODULES[args.engine]).ENGINE.problem()
        if problem is not None:
            result(what="engine", engine=args.engine, error=problem)
    import transformers

    try:
        # "-dirty": the measured tree had uncommitted changes (say which in the write-up)
        commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=REPO,
                                capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"
    except Exception:
        commit = "unknown"
    env = {"date": time.strftime("%Y-%m-%d"), "engine": args.engine, "engine_version": engine_version(args.engine),
           "device": torch.cuda.get_device_name(0) if gs.DEVICE == "cuda" else "CPU (smoke test)",
           "torch": torch.__version__, "transformers": transformers.__version__, "commit": commit,
           "sections": sections, **({"kit_set": list(KIT_SET)} if KIT_SET else {})}
    result(what="env", **env)
    root = Path(tempfile.mkdtemp(prefix=f"backends-{args.engine}-"))
    for name, fn in (("run", section_run), ("conformance", section_conformance), ("copies", section_copies)):
        if name not in sections:
            continue
        if time_left() < 60:
            result(what=name, engine=args.engine, error="not run: time budget of the device call")
            continue
        t = time.perf_counter()
        try:
            fn(args.engine, root)
        except Exception:
            result(what={"run": "grpo"}.get(name, name), engine=args.engine, error=traceback.format_exc()[-3000:])
        print(f"[{name}] done in {time.perf_counter() - t:.1f}s", flush=True)
    table = markdown(args.engine, env)
    print(table, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"results-{args.engine}.json").write_text(json.dumps({"env": env, "results": RESULTS}, indent=2,
                                                                         default=str))
        (args.out / f"backends-{args.engine}.md").write_text(table)


if __name__ == "__main__":
    main()
