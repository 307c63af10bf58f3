"""The vLLM-specific logic of the plugin as pure functions (unit-tested without vLLM installed).

Matched against the vLLM 0.26.0 sources (wheel ``vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64``):

* ``vllm/sampling_params.py`` ``SamplingParams``: ``top_k=0`` disables top-k, a temperature below
  1e-5 means greedy (vLLM then forces top_p=1, top_k=0), temperatures in (0, 0.01) are raised to
  0.01 (with a warning per request), temperatures above 2 raise ``VLLMValidationError``,
  ``min_tokens <= max_tokens`` and ``max_tokens >= 1`` are required; ``min_tokens`` suppresses
  every id of ``_all_stop_token_ids``; ``ignore_eos=True`` only disables the EOS *stop* check, not
  ``stop_token_ids``; ``flat_logprobs=True`` returns ``FlatLogprobs``.
* ``vllm/v1/engine/input_processor.py``: ``update_from_generation_config`` adds the model's
  generation-config EOS ids to ``_all_stop_token_ids`` even with ``ignore_eos`` and even with
  ``generation_config="vllm"`` (that setting only drops the sampling defaults), so
  ``min_tokens`` also masks the model's EOS ids.
* ``vllm/outputs.py`` ``RequestOutput`` / ``CompletionOutput``: ``request_id`` is the id given to
  ``add_request`` (vLLM appends a random suffix internally, ``abort_request`` takes either);
  with ``RequestOutputKind.FINAL_ONLY`` one output per request, when it finishes, holding all its
  ``token_ids`` and ``logprobs``. ``LLMEngine.abort_request`` produces no output (only ``AsyncLLM``
  gets a final "abort" one); ``vllm/v1/engine/output_processor.py``: ``OutputProcessor``
  maps external ids to internal ones (``external_req_ids``) and keeps a ``RequestState`` per
  internal id (``request_states``) whose ``detokenizer.output_token_ids`` and
  ``logprobs_processor.logprobs`` hold what the request has produced so far.
* ``vllm/logprobs.py``: ``FlatLogprobs(start_indices, end_indices, token_ids, logprobs, ranks,
  decoded_tokens)`` or ``list[dict[int, Logprob]]``; with ``logprobs=0`` each position holds the
  sampled token only.
* ``vllm/v1/engine/__init__.py``: ``FINISH_REASON_STRINGS = ("stop", "length", "abort", "error",
  "repetition")``; ``vllm/v1/core/sched/utils.py`` ``check_stop`` tests stop ids before the length
  limit, so a stop id as the last allowed token finishes with "stop" (the contract's order).
* Samplers: dense models (Qwen2, Llama, ...) run on the V2 model runner by default
  (``vllm/config/vllm.py`` ``use_v2_model_runner``; ``vllm/v1/worker/gpu/sample/sampler.py``), MoE
  models on V1 (``vllm/v1/sample/sampler.py``). In both, ``logprobs_mode`` "raw_logprobs" is
  ``log_softmax`` of the raw logits (no temperature, no min-tokens mask); "processed_logprobs" is
  ``log_softmax`` after the min-tokens mask, the temperature *and* the top-k/top-p mask (greedy
  rows: temperature 1). vLLM has no mode with the temperature but without top-k/top-p. Seeds: V2
  draws Gumbel noise from ``(seed, position)`` (free, batch-invariant); V1 keeps one
  ``torch.Generator`` per seeded request (a per-row loop, slower).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from rlcli.types import SampleParams
from rlcli.backends.engine_runtime import EnginePackage, managed_kwarg_issues

ENGINE = EnginePackage(
    label="vLLM", distribution="vllm", module="vllm", tested="0.26.0", minimum="0.26.0", plugin="rlcli-vllm"
)

WORKER_EXTENSION = "rlcli_vllm.worker_extension.RlcliWorkerExtension"

# EngineArgs the plugin sets itself; `engine_kwargs` may not override them.
MANAGED_ENGINE_KWARGS: dict[str, str] = {
    "trust_remote_code": "never: rlcli runs no code from a model directory or a recipe",
    "model": "the run's model directory",
    "tokenizer": "token-in/token-out: the engine never loads a tokenizer",
    "skip_tokenizer_init": "always true (token-in/token-out)",
    "dtype": "the run's dtype (model.dtype)",
    "seed": "the run's seed (trainer.seed)",
    "enable_sleep_mode": "always true (colocated sleep/wake_up)",
    "worker_extension_cls": "the plugin's weight-loading extension",
    "generation_config": "'vllm': the model's generation_config.json never changes sampling defaults",
    "logprobs_mode": "use the logprobs_mode option",
    "gpu_memory_utilization": "use the gpu_memory_utilization option",
    "kv_cache_memory_bytes": "gpu_memory_utilization 'auto' sizes it from the recipe; give a share instead",
    "max_model_len": "use the max_model_len option",
    "tensor_parallel_size": "use the tensor_parallel_size option",
    "enforce_eager": "use the cuda_graphs option (cuda_graphs false is enforce_eager true)",
    "max_num_seqs": "use the max_batch_size option",
    "enable_prefix_caching": "use the enable_prefix_caching option",
    "distributed_executor_backend": "the plugin runs the engine in process ('uni')",
}

# vLLM's SamplingParams accepts temperatures in [0, 2] and raises those in (0, MIN_TEMPERATURE) to it.
MAX_TEMPERATURE = 2.0
MIN_TEMPERATURE = 0.01
# vLLM's V2 model runner masks at most this many stop ids during min_tokens; more raise a
# ValueError inside the engine step (vllm/v1/worker/gpu/sample/logit_bias.py), failing the batch.
MAX_MIN_TOKENS_STOP_IDS = 128

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"vLLM serves bfloat16, float16 or float32 models, not {dtype}") from None


# vLLM's KV-cache block (CacheConfig.DEFAULT_BLOCK_SIZE; the CUDA attention backends keep it) and the
# block its BlockPool holds back (null_block).
BLOCK_SIZE = 16
RESERVED_BLOCKS = 1
# gpu_memory_utilization when 'auto' has no workload to size from (a context built by hand)
FALLBACK_UTILIZATION = 0.5
_KV_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "bfloat16": 2, "float16": 2, "float32": 4}


def kv_layout(cfg: Any) -> tuple[int, int | None]:
    """``(block size, KV bytes per element or None for the model dtype)`` of the engine this config
    builds (``engine_kwargs`` may set ``block_size`` and ``kv_cache_dtype``)."""
    extra = cfg.engine_kwargs
    return int(extra.get("block_size") or BLOCK_SIZE), _KV_DTYPE_BYTES.get(str(extra.get("kv_cache_dtype", "auto")))


def memory_kwargs(cfg: Any, kv: Any = None, *, weight_bytes: int = 0,
                  device_bytes: int | None = None) -> dict[str, Any]:
    """vLLM's memory arguments. An explicit ``gpu_memory_utilization`` share goes through as it is.
    'auto' with a KV budget ``kv`` (:class:`~rlcli.backends.engine_runtime.KVBudget`) passes
    ``kv_cache_memory_bytes`` (vLLM 0.26 then skips its memory profiling and ignores the share for
    the cache, ``vllm/v1/worker/gpu_worker.py`` ``determine_available_memory``) and, as the share,
    what the weights and that cache take of the device (rounded up to 0.01): with an absolute cache
    vLLM reads the share only in its start-up check (free memory >= share x total,
    ``vllm/v1/worker/utils.py`` ``request_memory``), so the check asks for what the engine really
    holds. 'auto' without a budget: :data:`FALLBACK_UTILIZATION`."""
    if cfg.gpu_memory_utilization != "auto":
        return {"gpu_memory_utilization": cfg.gpu_memory_utilization}
    if kv is None:
        return {"gpu_memory_utilization": FALLBACK_UTILIZATION}
    share = 0.01
    if device_bytes:
        share = min(1.0, max(share, math.ceil(100 * (weight_bytes + kv.nbytes) / device_bytes) / 100))
    return {"gpu_memory_utilization": share, "kv_cache_memory_bytes": int(kv.nbytes)}


def engine_kwargs(cfg: Any, *, model_dir: str, dtype: torch.dtype, seed: int,
                  memory: dict[str, Any] | None = None, max_batch_size: int | None = None) -> dict[str, Any]:
    """``vllm.EngineArgs`` keyword arguments for the plugin's config and a run (``memory``: from
    :func:`memory_kwargs`; default: those of a config without a KV budget; ``max_batch_size``: the
    run's, default the config's)."""
    kw: dict[str, Any] = dict(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype=dtype_name(dtype),
        seed=int(seed),
        enable_sleep_mode=True,
        worker_extension_cls=WORKER_EXTENSION,
        generation_config="vllm",
        logprobs_mode=cfg.logprobs_mode,
        tensor_parallel_size=cfg.tensor_parallel_size,
        enforce_eager=not cfg.cuda_graphs,
        distributed_executor_backend="uni",
        disable_log_stats=True,
    )
    kw.update(memory if memory is not None else memory_kwargs(cfg))
    if cfg.max_model_len is not None:
        kw["max_model_len"] = cfg.max_model_len
    batch = max_batch_size if max_batch_size is not None else cfg.max_batch_size
    if batch is not None:
        kw["max_num_seqs"] = int(batch)
    if cfg.enable_prefix_caching is not None:
        kw["enable_prefix_caching"] = cfg.enable_prefix_caching
    kw.update(cfg.engine_kwargs)
    return kw


def engine_environment(dtype: torch.dtype, environ: Mapping[str, str]) -> dict[str, str]:
    """Environment variables to set before vLLM builds an engine (those not set already).

    float32: vLLM 0.26 serves it with its Triton attention backend (FlashAttention and FlashInfer
    take fp16/bf16 only), and Triton's ``tl.dot`` on float32 inputs defaults to TF32; ``ieee`` keeps
    attention in full float32, like the rest of the model (vLLM sets torch's float32 matmul
    precision to "highest").
    """
    out: dict[str, str] = {}
    if dtype == torch.float32 and "TRITON_F32_DEFAULT" not in environ:
        out["TRITON_F32_DEFAULT"] = "ieee"
    return out


def check_engine_kwargs(extra: dict[str, Any], known: set[str] | None = None) -> list[tuple[str, str]]:
    """Problems with ``engine_kwargs``: keys the plugin manages, and (when ``known``, the
    ``EngineArgs`` field names, is given) keys vLLM does not have."""
    issues = managed_kwarg_issues(extra, MANAGED_ENGINE_KWARGS)
    if known is not None:
        issues += [("engine_kwargs", f"{key!r} is not a vllm.EngineArgs field")
                   for key in extra if key not in known and key not in MANAGED_ENGINE_KWARGS]
    return issues


def sampling_kwargs(params: SampleParams, *, stop_ids: Sequence[int], budget: int, seed: int | None) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments for one request (the caller adds
    ``output_kind=RequestOutputKind.FINAL_ONLY``).

    Stops are the plugin's: ``ignore_eos=True`` switches vLLM's own EOS off and ``stop_token_ids``
    carries the run's EOS ids (unless the request ignores EOS) and the request's stop ids, so the
    stop set is exactly the contract's. The stop token is part of the returned tokens.
    """
    greedy = params.temperature == 0.0
    kw: dict[str, Any] = dict(
        n=1,
        max_tokens=int(budget),
        min_tokens=min(int(params.min_tokens), int(budget)),
        temperature=0.0 if greedy else float(params.temperature),
        top_p=1.0 if greedy else float(params.top_p),
        top_k=0 if greedy else int(params.top_k),
        min_p=0.0,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        stop_token_ids=[int(t) for t in stop_ids],
        ignore_eos=True,
        detokenize=False,
        skip_special_tokens=False,
    )
    if params.return_logprob:  # the sampled token's logprob (vLLM's logprob path halves its decode rate)
        kw.update(logprobs=0, flat_logprobs=True)
    if seed is not None:
        kw["seed"] = int(seed)
    return kw


def token_logprobs(token_ids: Sequence[int], logprobs: Any) -> list[float]:
    """The sampled tokens' logprobs from a ``CompletionOutput.logprobs`` delta.

    Accepts ``FlatLogprobs`` (the last ``len(token_ids)`` positions are used) and
    ``list[dict[int, Logprob | float]]``. Raises ``ValueError`` when a position lacks its token.
    """
    n = len(token_ids)
    if n == 0:
        return []
    if logprobs is None:
        raise ValueError("vLLM returned no logprobs (the request must set SamplingParams.logprobs=0)")
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs
        starts, ends = logprobs.start_indices, logprobs.end_indices
        ids, vals = logprobs.token_ids, logprobs.logprobs
        if len(starts) < n:
            raise ValueError(f"vLLM returned logprobs for {len(starts)} positions, {n} tokens")
        first = len(starts) - n
        out = []
        for i, tok in enumerate(token_ids):
            s, e = starts[first + i], ends[first + i]
            for j in range(s, e):
                if ids[j] == tok:
                    out.append(float(vals[j]))
                    break
            else:
                raise ValueError(f"vLLM logprobs of position {i} lack the sampled token {tok}")
        return out
    positions = list(logprobs)
    if len(positions) < n:
        raise ValueError(f"vLLM returned logprobs for {len(positions)} positions, {n} tokens")
    out = []
    for i, (tok, pos) in enumerate(zip(token_ids, positions[len(positions) - n :])):
        if not pos or tok not in pos:
            raise ValueError(f"vLLM logprobs of position {i} lack the sampled token {tok}")
        value = pos[tok]
        out.append(float(getattr(value, "logprob", value)))
    return out


def finish_reason(reason: str | None) -> str | None:
    """The contract's finish reason for a vLLM one (None while the request runs).

    "repetition" (vLLM's optional repetition detector, never enabled by the plugin) ended the
    response without a stop token before ``max_tokens``: reported as "length".
    """
    if reason is None:
        return None
    reason = str(reason)
    if reason in ("stop", "length", "abort", "error"):
        return reason
    if reason == "repetition":
        return "length"
    return "error"


def request_problem(params: SampleParams, masked_ids: Sequence[int] = ()) -> str | None:
    """Why vLLM would refuse ``params`` (an ``error`` message), or None.

    ``masked_ids``: the ids vLLM's min-tokens mask would hold (the request's stop ids and the
    model's EOS ids).
    """
    if params.temperature > MAX_TEMPERATURE:
        return f"vLLM accepts temperatures in [0, {MAX_TEMPERATURE:g}], not {params.temperature:g}"
    if params.min_tokens > 0 and len(set(masked_ids)) > MAX_MIN_TOKENS_STOP_IDS:
        return (
            f"vLLM's min_tokens mask holds at most {MAX_MIN_TOKENS_STOP_IDS} stop ids; this request has "
            f"{len(set(masked_ids))} (stop_token_ids and EOS ids)"
        )
    return None


def logprob_caveat(mode: str, params: SampleParams) -> str | None:
    """Why vLLM's logprobs for ``params`` under ``mode`` are not ``log_softmax(logits / T)``."""
    greedy = params.temperature == 0.0
    if not greedy and params.temperature < MIN_TEMPERATURE:
        return (
            f"vLLM raises temperatures below {MIN_TEMPERATURE:g} to {MIN_TEMPERATURE:g}: requests at "
            f"temperature {params.temperature:g} are sampled (and their logprobs computed) at {MIN_TEMPERATURE:g}"
        )
    if mode == "processed_logprobs" and not greedy and (params.top_k > 0 or params.top_p < 1.0):
        return (
            "with logprobs_mode 'processed_logprobs' vLLM renormalises logprobs over the top-k/top-p set; "
            "the trainer's recomputed logprobs will differ for requests with top_k > 0 or top_p < 1"
        )
    if mode == "processed_logprobs" and params.min_tokens > 0:
        return (
            "with logprobs_mode 'processed_logprobs' vLLM leaves the stop ids (and the model's EOS ids, even "
            "with ignore_eos) out of the normaliser for the first min_tokens tokens; the trainer's recomputed "
            "logprobs will differ slightly there"
        )
    if mode == "raw_logprobs" and not greedy and params.temperature != 1.0:
        return (
            "with logprobs_mode 'raw_logprobs' vLLM returns temperature-1 logprobs; the trainer's "
            f"recomputed logprobs at temperature {params.temperature} will differ"
        )
    return None
