"""``benchmarks/backends.py``'s section "run": the engine behind ``ColocateRunner`` next to its
trainer, as ``rlcli train`` builds them; throughput through rlcli and bare (``backends_throughput``),
``--host-profile``'s profiles, ``--kernel-profile``'s GPU kernel summaries (``engine_kernels``), then
three GRPO steps (``runner.fit()``)."""

from __future__ import annotations

import gc
import importlib
import math
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

import torch

import backends_common as common
import grpo_step as gs
from backends_common import GRPO_STEPS, PLUGIN_MODULES, K, NotRun, result
from backends_throughput import host_profile, paired_ratio, throughput, throughput_paths, workload


def run_rollout_config(engine: str, sequences: int) -> dict[str, Any]:
    """The run section's rollout config of ``engine``, with ``--run-set`` applied on top."""
    from rlcli.overrides import apply_overrides

    shared = {"max_model_len": 512, "max_batch_size": sequences}
    base = {
        "embedded": {"name": "embedded", **shared},
        "vllm": {"name": "vllm", "gpu_memory_utilization": 0.35, **shared},
        "sglang": {"name": "sglang", "mem_fraction_static": 0.35, **shared},
        "lmdeploy": {"name": "lmdeploy", "cache_max_entry_count": 0.35, **shared},
    }[engine]
    return apply_overrides(base, common.RUN_SET)


def section_run(engine: str, root: Path) -> None:
    runner = build_runner(engine, root)
    rows: list[dict] = []
    try:
        prompts = workload()
        report_throughput(engine, runner.backend, prompts)
        if common.HOST_PROFILE is not None:
            report_host_profile(engine, runner.backend, prompts, common.HOST_PROFILE)
        if common.KERNEL_PROFILE:
            report_kernel_profile(engine, runner.backend, prompts, root / "kernels")
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
    report_grpo(engine, rows)


def build_runner(engine: str, root: Path):
    """The ``ColocateRunner`` of the GRPO benchmark's recipe with ``rollout.name=<engine>`` (the
    engine's plugin registered here when it is not pip-installed); records its start-up time."""
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
    result(what="engine_settings", engine=engine, settings=engine_settings(engine, runner.backend))
    return runner


# Where each engine keeps the settings that size its work (concurrency, CUDA graphs, KV cache, chunked
# prefill), as ``(backend attribute, engine attribute, [dotted paths below it])``: read after start-up so
# that the table states what the engine chose, defaults included (vLLM 0.26 ``LLMEngine.vllm_config``,
# SGLang 0.5.17 ``Engine.server_args``, LMDeploy 0.18 ``Engine.engine_config``).
ENGINE_SETTINGS = {
    "vllm": ("_engine", "vllm_config", [
        "scheduler_config.max_num_seqs", "scheduler_config.max_num_batched_tokens",
        "scheduler_config.enable_chunked_prefill", "cache_config.block_size", "cache_config.num_gpu_blocks",
        "cache_config.gpu_memory_utilization", "compilation_config.cudagraph_capture_sizes"]),
    "sglang": ("_sgl", "server_args", [
        "max_running_requests", "cuda_graph_max_bs_decode", "disable_cuda_graph", "max_total_tokens",
        "mem_fraction_static", "chunked_prefill_size", "page_size"]),
    "lmdeploy": ("_lmd", "engine_config", [
        "max_batch_size", "num_gpu_blocks", "block_size", "cache_max_entry_count", "eager_mode",
        "max_prefill_token_num"]),
}


def engine_settings(engine: str, backend) -> dict[str, Any]:
    """The settings of ``ENGINE_SETTINGS`` the engine behind ``backend`` has (a list is given as its
    length and largest value); those it lacks are left out, and nothing here raises."""
    if engine not in ENGINE_SETTINGS:
        return {}
    outer, inner, paths = ENGINE_SETTINGS[engine]
    root = getattr(getattr(backend, outer, None), inner, None)
    found: dict[str, Any] = {}
    for path in paths:
        value = root
        for part in path.split("."):
            value = getattr(value, part, None)
        if isinstance(value, (list, tuple)):
            value = {"count": len(value), "max": max(value)} if value else []
        if value is not None:
            found[path] = value if isinstance(value, (bool, int, float, str, dict, list)) else str(value)
    return found


def report_throughput(engine: str, backend, prompts: list[list[int]]) -> None:
    """The throughput rounds, recorded as one ``throughput`` result (or its error): each path's best
    round and its ratio to the best bare round, the median of its per-round ratios to bare and, for
    plain, their quartiles."""
    try:
        rates = throughput(engine, backend, prompts)
        bare_rate = max(rates["bare"])
        keys = {"plain": ("rlcli_tok_s", "ratio"), "seeded": ("rlcli_seeded_tok_s", "seeded_ratio"),
                "batched": ("batched_tok_s", "batched_ratio"), "bare_each": ("bare_each_tok_s", None)}
        fields: dict[str, Any] = {"bare_tok_s": round(bare_rate)}
        for path, (rate_key, ratio_key) in keys.items():
            if path not in rates:
                continue
            fields[rate_key] = round(max(rates[path]))
            if ratio_key is not None:
                fields[ratio_key] = round(max(rates[path]) / bare_rate, 3)
                fields[f"{ratio_key}_paired_median"] = round(paired_ratio(rates, path), 3)
        if "plain" in rates and len(rates["bare"]) >= 2:
            per_round = [p / b for p, b in zip(rates["plain"], rates["bare"])]
            fields["ratio_paired_quartiles"] = [round(q, 3) for q in statistics.quantiles(per_round, n=4)]
        result(what="throughput", engine=engine, sequences=len(prompts) * K, new_tokens=gs.NEW, **fields,
               rounds={k: [round(r) for r in v] for k, v in rates.items()})
    except Exception:
        result(what="throughput", engine=engine, error=traceback.format_exc()[-2000:])


def report_host_profile(engine: str, backend, prompts: list[list[int]], where: Path) -> None:
    """``--host-profile``: one plain and one bare round profiled, written as
    ``host-profile-<engine>-{plain,bare}.txt`` in ``where``."""
    try:
        texts = host_profile(engine, backend, prompts)
        where.mkdir(parents=True, exist_ok=True)
        for name, text in texts.items():
            (where / f"host-profile-{engine}-{name}.txt").write_text(text)
        result(what="host_profile", engine=engine,
               rates={k: v.splitlines()[0] for k, v in texts.items()}, dir=str(where))
    except NotRun as exc:
        result(what="host_profile", engine=engine, error=f"not run: {exc}")
    except Exception:
        result(what="host_profile", engine=engine, error=traceback.format_exc()[-2000:])


def report_kernel_profile(engine: str, backend, prompts: list[list[int]], where: Path) -> None:
    """``--kernel-profile``: one bare and one plain round under the GPU profiler, each recorded as a
    ``kernel_profile`` result with ``engine_kernels.summarise``'s per-step figures (the traces stay in
    ``where``: too large to come back from the device)."""
    from engine_kernels import load_gpu_events, profiled_round, summarise

    paths = throughput_paths(engine, backend, prompts)
    tokens, rows = len(prompts) * K * gs.NEW, len(prompts) * K
    for name in ("bare", "plain"):
        try:
            trace, rate = profiled_round(engine, backend, paths[name], where, f"kernels-{engine}-{name}")
            summary = summarise(load_gpu_events(trace), tokens, rows, wall_s=tokens / rate)
            result(what="kernel_profile", engine=engine, path=name, tok_s=round(rate), trace=str(trace),
                   summary=summary)
        except Exception:
            result(what="kernel_profile", engine=engine, path=name, error=traceback.format_exc()[-2000:])


def report_grpo(engine: str, rows: list[dict]) -> None:
    """The GRPO steps' logged rows, recorded as one ``grpo`` result."""
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
