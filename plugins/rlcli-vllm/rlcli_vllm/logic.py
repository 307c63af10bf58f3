"""The vLLM-specific logic of the plugin as pure functions (unit-tested without vLLM installed).

Matched against the vLLM 0.26.0 sources (wheel ``vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64``):

* ``vllm/sampling_params.py`` ``SamplingParams``: ``top_k=0`` disables top-k, a temperature below
  1e-5 means greedy (vLLM then forces top_p=1, top_k=0), temperatures in (0, 0.01) are raised to
  0.01, ``min_tokens`` suppresses every id of ``_all_stop_token_ids`` (our ``stop_token_ids``),
  ``ignore_eos=True`` only disables the tokenizer/generation-config EOS check, not
  ``stop_token_ids``; ``flat_logprobs=True`` returns ``FlatLogprobs``.
* ``vllm/outputs.py`` ``RequestOutput`` / ``CompletionOutput``: ``request_id`` is the id given to
  ``add_request`` (vLLM appends a random suffix internally, ``abort_request`` takes either);
  ``token_ids`` and ``logprobs`` are deltas with ``RequestOutputKind.DELTA``
  (``vllm/v1/engine/output_processor.py`` slices ``logprobs[-len(token_ids):]``).
* ``vllm/logprobs.py``: ``FlatLogprobs(start_indices, end_indices, token_ids, logprobs, ranks,
  decoded_tokens)`` or ``list[dict[int, Logprob]]``; with ``logprobs=0`` each position holds the
  sampled token only.
* ``vllm/v1/engine/__init__.py``: ``FINISH_REASON_STRINGS = ("stop", "length", "abort", "error",
  "repetition")``.
* ``vllm/v1/sample/sampler.py`` and ``ops/topk_topp_sampler.py``: ``logprobs_mode``
  "raw_logprobs" is ``log_softmax`` of the raw logits (no temperature); "processed_logprobs" is
  ``log_softmax`` after the logits processors (min-tokens masking), the temperature *and* the
  top-k/top-p mask. vLLM has no mode with the temperature but without top-k/top-p.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from rlcli.types import SampleParams
from rlcli.backends.engine_runtime import EnginePackage, managed_kwarg_issues

ENGINE = EnginePackage(
    label="vLLM", distribution="vllm", module="vllm", tested="0.26.0", minimum="0.26.0", plugin="rlcli-vllm"
)

WORKER_EXTENSION = "rlcli_vllm.worker_extension.RlcliWorkerExtension"

# EngineArgs the plugin sets itself; `engine_kwargs` may not override them.
MANAGED_ENGINE_KWARGS: dict[str, str] = {
    "model": "the run's model directory",
    "tokenizer": "token-in/token-out: the engine never loads a tokenizer",
    "skip_tokenizer_init": "always true (token-in/token-out)",
    "dtype": "the run's dtype (model.dtype)",
    "seed": "the run's seed (trainer.seed)",
    "enable_sleep_mode": "always true (colocated sleep/wake_up)",
    "worker_extension_cls": "the plugin's weight-loading extension",
    "generation_config": "'vllm': the model's generation_config.json never changes sampling",
    "logprobs_mode": "use the logprobs_mode option",
    "gpu_memory_utilization": "use the gpu_memory_utilization option",
    "max_model_len": "use the max_model_len option",
    "tensor_parallel_size": "use the tensor_parallel_size option",
    "enforce_eager": "use the enforce_eager option",
    "max_num_seqs": "use the max_batch_size option",
    "enable_prefix_caching": "use the enable_prefix_caching option",
    "distributed_executor_backend": "the plugin runs the engine in process ('uni')",
}

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"vLLM serves bfloat16, float16 or float32 models, not {dtype}") from None


def engine_kwargs(cfg: Any, *, model_dir: str, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    """``vllm.EngineArgs`` keyword arguments for the plugin's config and a run."""
    kw: dict[str, Any] = dict(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype=dtype_name(dtype),
        seed=int(seed),
        enable_sleep_mode=True,
        worker_extension_cls=WORKER_EXTENSION,
        generation_config="vllm",
        logprobs_mode=cfg.logprobs_mode,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        tensor_parallel_size=cfg.tensor_parallel_size,
        enforce_eager=cfg.enforce_eager,
        distributed_executor_backend="uni",
        disable_log_stats=True,
    )
    if cfg.max_model_len is not None:
        kw["max_model_len"] = cfg.max_model_len
    if cfg.max_batch_size is not None:
        kw["max_num_seqs"] = cfg.max_batch_size
    if cfg.enable_prefix_caching is not None:
        kw["enable_prefix_caching"] = cfg.enable_prefix_caching
    kw.update(cfg.engine_kwargs)
    return kw


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
    ``output_kind=RequestOutputKind.DELTA``).

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
        logprobs=0,
        flat_logprobs=True,
        detokenize=False,
        skip_special_tokens=False,
    )
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


def logprob_caveat(mode: str, params: SampleParams) -> str | None:
    """Why vLLM's logprobs for ``params`` under ``mode`` are not ``log_softmax(logits / T)``."""
    greedy = params.temperature == 0.0
    if mode == "processed_logprobs" and not greedy and (params.top_k > 0 or params.top_p < 1.0):
        return (
            "with logprobs_mode 'processed_logprobs' vLLM renormalises logprobs over the top-k/top-p set; "
            "the trainer's recomputed logprobs will differ for requests with top_k > 0 or top_p < 1"
        )
    if mode == "raw_logprobs" and not greedy and params.temperature != 1.0:
        return (
            "with logprobs_mode 'raw_logprobs' vLLM returns temperature-1 logprobs; the trainer's "
            f"recomputed logprobs at temperature {params.temperature} will differ"
        )
    return None
