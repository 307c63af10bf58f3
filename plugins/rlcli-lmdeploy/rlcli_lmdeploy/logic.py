"""The LMDeploy-specific logic of the plugin as pure functions (unit-tested without LMDeploy).

Matched against the LMDeploy 0.18.0 sources (wheel ``lmdeploy-0.18.0-cp312-cp312-manylinux_2_28_x86_64``):

* ``lmdeploy/messages.py`` ``GenerationConfig``: ``top_k`` defaults to 50 and ``temperature`` to
  0.8 (the plugin always sets both); ``temperature`` must lie in [0, 2]; ``logprobs`` must be at
  least 1 for any logprob to come back (``pytorch/engine/engine_loop.py`` only fills them when
  ``num_logprobs > 0``), and only when ``PytorchEngineConfig.logprobs_mode`` is set (its default
  ``None`` computes none: ``logprobs=None`` in every output). ``EngineOutput(status, token_ids,
  logprobs, ...)`` with ``logprobs`` a ``list[dict[int, float]]`` (sampled token first, then the
  top-``logprobs`` ids; one dict when the sampled token is the top one).
* ``lmdeploy/pytorch/messages.py`` ``SamplingParam.from_gen_config``: ``temperature == 0`` becomes
  top_k 1 at temperature 1; ``top_k <= 0`` disables top-k; with ``ignore_eos`` the stop ids become
  *banned* ids (``bad_words``), so the plugin never sets ``ignore_eos`` and passes exactly the stop
  ids that should stop; ``min_new_tokens`` masks the stop ids until reached.
* ``lmdeploy/pytorch/engine/engine_instance.py`` ``EngineInstance.async_stream_infer``: yields
  ``SUCCESS`` deltas (new token ids + their logprobs; several tokens at once when the reader
  lagged, as the engine overwrites one response object per request), then ``FINISH`` or ``CANCEL``
  (``async_cancel(session_id)``, which returns None) with the tokens not yet read and their
  logprobs; any other ``ResponseType`` is an error. The stop token is part of ``token_ids``
  (``AsyncEngine`` strips it; the plugin does not). Closing the stream ends the session.
* ``lmdeploy/pytorch/engine/engine.py`` ``Engine``: ``session_len`` None means "as many tokens as
  the KV cache holds" (``AsyncEngine`` fills in the model's context; the plugin does too);
  ``sleep(level)`` is a coroutine, ``wakeup(tags)`` is not; the uni executor has no
  ``update_params``. ``random_seed`` is used modulo 2**32 with the token position as offset.
* ``lmdeploy/pytorch/engine/logits_process.py`` ``FusedLogitsProcessor``: ``logprobs_mode``
  "raw_logprobs" is ``log_softmax`` of the raw logits before temperature, penalties, min-tokens
  masking and top-k/top-p; the only other mode is "raw_logits". So logprobs are the contract's
  value at temperature 1 (and greedy) and temperature-1 logprobs otherwise. ``log_softmax`` runs
  in the logits' dtype, and the logits come from ``ModelAgent.get_logits``
  (``lmdeploy/pytorch/engine/model_agent/agent.py``; called outside the CUDA graphs, for sampling
  and logprobs alike) in the lm-head's dtype: bfloat16 logprobs for a bfloat16 model unless
  upcast (:func:`upcast_logits`).
* ``lmdeploy/pytorch/nn/embedding.py`` ``ParallelEmbedding.weight_loader`` sets
  ``weight[padding_idx] = 0`` after loading, and the models pass ``config.pad_token_id`` as
  ``padding_idx`` (``lmdeploy/pytorch/models/qwen2.py``); the LM head shares that weight when the
  embeddings are tied. ``PytorchEngineConfig.hf_overrides`` edits the model's config before the
  model is built (``lmdeploy/pytorch/config.py`` ``override_hf_config``), so ``pad_token_id: None``
  keeps the row (:func:`engine_config_kwargs`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from rlcli.types import SampleParams
from rlcli.backends.engine_runtime import EnginePackage, managed_kwarg_issues

ENGINE = EnginePackage(
    label="LMDeploy",
    distribution="lmdeploy",
    module="lmdeploy",
    tested="0.18.0",
    minimum="0.18.0",
    plugin="rlcli-lmdeploy",
)

# PytorchEngineConfig fields the plugin sets itself; `engine_kwargs` may not override them.
MANAGED_ENGINE_KWARGS: dict[str, str] = {
    "trust_remote_code": "never: rlcli runs no code from a model directory or a recipe",
    "custom_module_map": "never: rlcli runs no code from a model directory or a recipe",
    "dtype": "the run's dtype (model.dtype)",
    "tp": "one GPU per engine (the plugin loads weights in process)",
    "device_type": "cuda",
    "logprobs_mode": "always 'raw_logprobs'",
    "enable_prefix_caching": "off: LMDeploy cannot invalidate cached prefixes on a weight update",
    "enable_mp_engine": "off: the engine runs in process",
    "distributed_executor_backend": "'uni': the engine runs in process",
    "empty_init": "off: the engine loads the model directory",
    "cache_max_entry_count": "use the cache_max_entry_count option",
    "num_gpu_blocks": "cache_max_entry_count 'auto' sizes it from the recipe; give a share instead",
    "session_len": "use the max_model_len option",
    "max_batch_size": "use the max_batch_size option",
    "eager_mode": "use the cuda_graphs option (cuda_graphs false is eager_mode true)",
}

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
MAX_TEMPERATURE = 2.0


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"LMDeploy's PyTorch engine serves bfloat16 or float16 models, not {dtype}") from None


# PytorchEngineConfig.block_size's default, the blocks LMDeploy holds back for dummy inputs
# (pytorch/engine/config_builder.py: num_reserved_gpu_blocks=1), and the cache_max_entry_count
# 'auto' falls back to without a workload to size from (a context built by hand).
BLOCK_SIZE = 64
RESERVED_BLOCKS = 1
FALLBACK_CACHE_SHARE = 0.5


def memory_kwargs(cfg: Any, kv: Any = None) -> dict[str, Any]:
    """LMDeploy's memory arguments. An explicit ``cache_max_entry_count`` goes through as it is
    (PytorchEngineConfig asserts 0 < value < 1: a share, never a block count, in 0.18). 'auto' with
    a KV budget ``kv`` passes ``num_gpu_blocks`` (LMDeploy 0.18 then keeps that count,
    ``pytorch/engine/executor/base.py`` ``_update_num_gpu_blocks``) and no share: LMDeploy's default
    (0.8) then only enters its estimate of the prefill buffers. 'auto' without a budget:
    :data:`FALLBACK_CACHE_SHARE`."""
    if cfg.cache_max_entry_count != "auto":
        return {"cache_max_entry_count": cfg.cache_max_entry_count}
    if kv is None:
        return {"cache_max_entry_count": FALLBACK_CACHE_SHARE}
    return {"num_gpu_blocks": int(kv.blocks)}


def engine_config_kwargs(cfg: Any, *, dtype: torch.dtype, session_len: int | None = None,
                         memory: dict[str, Any] | None = None, max_batch_size: int | None = None) -> dict[str, Any]:
    """``lmdeploy.PytorchEngineConfig`` keyword arguments for the plugin's config and a run.

    ``session_len`` is the model's context (``max_position_embeddings``), used when the
    ``max_model_len`` option is unset: LMDeploy's ``Engine`` (unlike its ``pipeline``) does not
    read it from the model and would otherwise allow as many tokens as the KV cache holds.
    ``memory``: from :func:`memory_kwargs` (default: those of a config without a KV budget);
    ``max_batch_size``: the run's (default: the config's).
    """
    kw: dict[str, Any] = dict(
        dtype=dtype_name(dtype),
        tp=1,
        device_type="cuda",
        logprobs_mode="raw_logprobs",
        enable_prefix_caching=False,
        enable_mp_engine=False,
        distributed_executor_backend="uni",
        eager_mode=not cfg.cuda_graphs,
    )
    kw.update(memory if memory is not None else memory_kwargs(cfg))
    if (cfg.max_model_len or session_len) is not None:
        kw["session_len"] = int(cfg.max_model_len or session_len)
    batch = max_batch_size if max_batch_size is not None else cfg.max_batch_size
    if batch is not None:
        kw["max_batch_size"] = int(batch)
    kw.update(cfg.engine_kwargs)
    # LMDeploy zeroes the embedding row of the config's pad_token_id whenever it loads weights
    # (start-up and every update); with tied embeddings that row is also the LM head's, so the
    # pad token's logit becomes 0 and every logprob shifts against the trainer's. Without a
    # pad_token_id the rows are served as the checkpoint has them (unless the run sets its own).
    kw["hf_overrides"] = {"pad_token_id": None, **dict(kw.get("hf_overrides") or {})}
    return kw


def check_engine_kwargs(extra: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``engine_kwargs`` keys the plugin sets itself."""
    return managed_kwarg_issues(extra, MANAGED_ENGINE_KWARGS)


def generation_kwargs(
    params: SampleParams, *, stop_ids: Sequence[int], budget: int, seed: int | None
) -> dict[str, Any]:
    """``lmdeploy.GenerationConfig`` keyword arguments for one request."""
    greedy = params.temperature == 0.0
    kw: dict[str, Any] = dict(
        n=1,
        max_new_tokens=int(budget),
        min_new_tokens=min(int(params.min_tokens), int(budget)),
        do_sample=not greedy,
        temperature=1.0 if greedy else float(params.temperature),
        top_k=1 if greedy else int(params.top_k),
        top_p=1.0 if greedy else float(params.top_p),
        min_p=0.0,
        repetition_penalty=1.0,
        ignore_eos=False,
        stop_token_ids=[int(t) for t in stop_ids] or None,
        logprobs=1 if params.return_logprob else None,  # None: LMDeploy computes none for this request
        skip_special_tokens=False,
    )
    if seed is not None:
        kw["random_seed"] = int(seed)
    return kw


def request_problem(params: SampleParams) -> str | None:
    if params.temperature > MAX_TEMPERATURE:
        return f"LMDeploy accepts temperatures up to {MAX_TEMPERATURE}, got {params.temperature}"
    return None


def token_logprobs(token_ids: Sequence[int], logprobs: Sequence[Mapping[int, float]] | None) -> list[float]:
    """The sampled tokens' logprobs from an ``EngineOutput.logprobs`` delta."""
    n = len(token_ids)
    if n == 0:
        return []
    if logprobs is None:
        raise ValueError("LMDeploy returned no logprobs (the engine needs logprobs_mode and GenerationConfig.logprobs)")
    if len(logprobs) != n:
        raise ValueError(f"LMDeploy returned logprobs for {len(logprobs)} positions, {n} tokens")
    out = []
    for i, (tok, pos) in enumerate(zip(token_ids, logprobs)):
        if tok not in pos:
            raise ValueError(f"LMDeploy logprobs of position {i} lack the sampled token {tok}")
        out.append(float(pos[tok]))
    return out


def finish_from_status(status: str, token_ids: Sequence[int], stop_ids: Sequence[int]) -> tuple[str | None, str | None]:
    """``(finish, error)`` for an ``EngineOutput`` status name (``ResponseType.name``); ``(None, None)``
    while the request runs. ``token_ids`` are all tokens generated so far."""
    if status == "SUCCESS":
        return None, None
    if status == "FINISH":
        return ("stop" if token_ids and token_ids[-1] in set(stop_ids) else "length"), None
    if status == "CANCEL":
        return "abort", None
    return "error", f"LMDeploy ended the request with {status}"


def logprob_caveat(params: SampleParams) -> str | None:
    if params.temperature not in (0.0, 1.0):
        return (
            "LMDeploy returns temperature-1 logprobs (logprobs_mode 'raw_logprobs'); the trainer's recomputed "
            f"logprobs at temperature {params.temperature} will differ"
        )
    return None


def upcast_logits(agent: Any) -> None:
    """Make LMDeploy's ``ModelAgent.get_logits`` return float32 logits (an instance attribute
    shadowing the method): sampling and ``log_softmax`` then run in float32, so logprobs are
    float32 values of the bf16 model's logits - as vLLM and SGLang return them - instead of being
    rounded to bfloat16 (up to 0.03 per token between -8 and -16). Costs a float32 copy of each
    step's logits (batch x vocab x 4 bytes). LMDeploy's own ``hf_overrides: {fp32_lm_head: true}``
    is not the same: it keeps the LM head (and a tied embedding) in float32, so its logits are not
    those of the bf16 weights the trainer computes with."""
    if getattr(agent, "_rlcli_float32_logits", False):
        return
    original = agent.get_logits

    def get_logits(hidden_states):
        return original(hidden_states).float()

    agent.get_logits = get_logits
    agent._rlcli_float32_logits = True
