"""``benchmarks/backends.py``'s section "conformance": every check of
``rlcli.testing.backend_conformance`` on the kit's two tiny qwen2 models, with the engine's settings
and tolerances, then the plugin checks the kit cannot see for an engine (logprobs in their exact
range, free device memory after sleep). The kit engines' settings serve the copies section too."""

from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import backends_common as common
import grpo_step as gs
from backends_common import PLUGIN_MODULES, NotRun, result, time_left


def kit_settings(settings: dict, extra: Sequence[str] = ()) -> dict:
    """The kit engines' backend settings with ``--kit-set`` (then ``extra``) applied on top."""
    from rlcli.overrides import apply_overrides

    return apply_overrides(settings, [*common.KIT_SET, *extra])


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
        settings = dict(gpu_memory_utilization=0.25, cuda_graphs=False, max_model_len=512)
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


def exact_range_logprobs(engine: str, make_backend, model_dir, dtype: torch.dtype) -> None:
    """Logprobs against the forward pass where the engine's logprob mode is exact."""
    from rlcli.testing import backend_conformance as bc

    settings = {"vllm": [dict(temperature=t) for t in (1.0, 0.7, 0.0)],
                "lmdeploy": [dict(temperature=1.0), dict(temperature=1.0, top_k=5, top_p=0.9), dict(temperature=0.0)]}
    settings = settings.get(engine, [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9)])
    bc.check_logprobs_match_forward(make_backend, model_dir, settings=settings, max_tokens=12,
                                    **bc.engine_options(dtype)["logprobs_match_forward"])


def sleep_releases_memory(make_backend, model_dir) -> str:
    """Free device memory after sleep(1)/sleep(2) and identical greedy outputs after wake_up."""
    from rlcli.testing import backend_conformance as bc

    if not torch.cuda.is_available():
        raise NotRun("no CUDA device: device memory cannot be measured")
    return bc.check_sleep_frees_device_memory(make_backend, model_dir, min_fraction=0.0)


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
        if common.CHECKS and name not in common.CHECKS:
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
