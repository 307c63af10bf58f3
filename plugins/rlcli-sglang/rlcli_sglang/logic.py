"""The SGLang-specific logic of the plugin as pure functions (unit-tested without SGLang installed).

Matched against the SGLang 0.5.17 sources (wheel ``sglang-0.5.17-cp311-cp311-manylinux_2_34_x86_64``):

* ``sglang/srt/sampling/sampling_params.py`` ``SamplingParams``: ``top_k=-1`` disables top-k
  (becomes ``TOP_K_ALL``; 0 is refused); a temperature below 1e-6 means greedy (SGLang sets
  temperature 1 and top_k 1); ``logit_bias`` is ``{str(token_id): bias}``; ``min_new_tokens > 0``
  is refused with ``skip_tokenizer_init`` (``raise_if_tokenizer_required``: it needs the
  tokenizer's EOS id), so the plugin implements ``min_tokens`` itself. The parameters travel to
  the scheduler process as a msgpack-encoded ``msgspec.Struct`` (``-inf`` survives).
* ``sglang/srt/sampling/sampling_batch_info.py`` / ``layers/sampler.py``: ``sampling_seed`` is read
  only with ``enable_deterministic_inference`` (which also forces the pytorch sampler); without it
  a request seed is silently ignored. The returned logprob is ``log(softmax(logits / T))`` over
  the whole vocabulary before top-k/top-p filtering (greedy: ``log_softmax(logits)``) - exactly the
  contract's value; ``logit_bias`` applies before it.
* ``sglang/srt/managers/schedule_batch.py`` ``Req.update_finish_state``: the length limit is
  checked *before* stop tokens and a pending abort before both, so a stop id sampled as the last
  allowed token reports ``length`` and a request aborted on its last step reports ``abort``
  (:func:`settle_finish` corrects both). ``ignore_eos=True`` disables *every* token stop,
  ``stop_token_ids`` included; otherwise the request also stops on the model's EOS ids
  (config.json and generation_config.json). The stop token is part of ``output_ids``. Finish
  reasons ``to_json()``: ``{"type": "stop", "matched": id}``, ``{"type": "length", "length": n}``,
  ``{"type": "abort", "message": ..., "status_code": ..., "err_type": ...}``.
* ``sglang/srt/managers/tokenizer_manager.py`` (``_handle_batch_output`` for ``BatchTokenIDOutput``,
  ``_handle_abort_req``, ``detokenize_logprob_tokens``): an output is ``{"output_ids": [...],
  "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens",
  "output_token_logprobs": [(logprob, token_id, None), ...], ...}}``; non-incremental stream chunks
  carry the cumulative lists, except the answer to an abort of a *queued* streamed request, whose
  ``output_ids`` holds only the last token (its ``output_token_logprobs`` stay cumulative, so
  :func:`parse_output` reads the tokens from them).
* ``sglang/srt/managers/tokenizer_manager.py`` (``_handle_batch_request``,
  ``_collect_batch_responses``) and ``io_struct.py`` (``GenerateReqInput``): a request whose
  ``input_ids`` is a list of lists (``sampling_params`` and ``rid`` lists of the same length) is a
  batch. With pre-tokenized input and no DP attention, every sub-request is validated and
  tokenized, then all go to the scheduler as one ``BatchTokenizedGenerateReqInput``; each keeps its
  rid (``abort_request(rid)`` ends that one alone). A sub-request refused before sending (too
  long, bad sampling parameters) or aborted before sending raises for the whole batch; one the
  scheduler refuses (``BAD_REQUEST``) raises once it answers, and the batch's other requests are
  then aborted. A non-streamed batch yields one list of the single-request outputs, in batch
  order, once all are done.
* ``sglang/srt/managers/tp_worker.py`` / ``scheduler.py``: ``max_req_len = context_len - 1``,
  ``max_new_tokens`` is clipped to ``max_req_len - prompt - 1`` and prompts of
  ``max_req_len - 5`` tokens or more are refused: a sequence holds at most ``context_len - 2``
  tokens (:func:`usable_context`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from rlcli.types import SampleParams
from rlcli.backends.engine_runtime import EnginePackage, managed_kwarg_issues

ENGINE = EnginePackage(
    label="SGLang", distribution="sglang", module="sglang", tested="0.5.17", minimum="0.5.17", plugin="rlcli-sglang"
)

# ServerArgs the plugin sets itself; `engine_kwargs` may not override them.
MANAGED_ENGINE_KWARGS: dict[str, str] = {
    "trust_remote_code": "never: rlcli runs no code from a model directory or a recipe",
    "model_path": "the run's model directory",
    "tokenizer_path": "token-in/token-out: the engine never loads a tokenizer",
    "skip_tokenizer_init": "always true (token-in/token-out)",
    "dtype": "the run's dtype (model.dtype)",
    "random_seed": "the run's seed (trainer.seed)",
    "base_gpu_id": "the run's device",
    "enable_memory_saver": "always true (colocated sleep/wake_up)",
    "enable_weights_cpu_backup": "always true (weights survive sleep level 2)",
    "incremental_streaming_output": "always false (the plugin reads cumulative stream chunks)",
    "mem_fraction_static": "use the mem_fraction_static option",
    "max_total_tokens": "mem_fraction_static 'auto' sizes it from the recipe; give a share instead",
    "context_length": "use the max_model_len option",
    "max_running_requests": "use the max_batch_size option",
    "tp_size": "use the tensor_parallel_size option",
    "disable_cuda_graph": "use the cuda_graphs option (cuda_graphs false is disable_cuda_graph true)",
}

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_NEG_INF = float("-inf")

# Measured with SGLang 0.5.17 (sgl-kernel) on an H200: a float32 engine's scheduler dies during
# start-up and SGLang's watchdog then SIGQUITs the whole rlcli process.
FLOAT32_REFUSAL = (
    "SGLang 0.5.17 cannot serve float32 models: sgl-kernel's fused RMSNorm (used by prefill and "
    "decode) has no float32 path - the scheduler dies at start-up with 'rmsnorm(...) failed to "
    "dispatch data type Float' and SGLang's watchdog then kills the whole process. "
    "Set model.dtype: bfloat16 (or float16)"
)


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's ``dtype`` server arg for a run dtype; float32 and others raise ``ValueError``."""
    if dtype == torch.float32:
        raise ValueError(FLOAT32_REFUSAL)
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"SGLang serves bfloat16 or float16 models, not {dtype} (set model.dtype: bfloat16)") from None


# SGLang's KV pool page (ServerArgs.page_size; 1 for the attention backends of dense models on
# Hopper), the mem_fraction_static that 'auto' passes with a pool size, and the one it falls back to
# without a workload to size from (a context built by hand).
PAGE_SIZE = 1
AUTO_STATIC_FRACTION = 0.9
FALLBACK_STATIC_FRACTION = 0.5

# Decode CUDA graphs. SGLang 0.5.17 sizes them from the GPU's memory, not from the workload: up to
# 256 rows on a 141 GB GPU with tp_size 1 (ServerArgs' memory-based defaults), and it decodes a
# larger batch without graphs, kernel by kernel. The plugin captures them up to the run's batch
# (max_running_requests; SGLang drops sizes above it), at most DECODE_GRAPH_ROWS_MAX rows: each
# captured size costs start-up time and about 2 MB that SGLang reserves per row of the largest.
# engine_kwargs that name graph sizes themselves win.
DECODE_GRAPH_ROWS_MAX = 1024
DECODE_GRAPH_KWARGS = ("cuda_graph_max_bs_decode", "cuda_graph_bs_decode", "cuda_graph_config")


def memory_kwargs(cfg: Any, kv: Any = None) -> dict[str, Any]:
    """SGLang's memory arguments. An explicit ``mem_fraction_static`` goes through as it is. 'auto'
    with a KV budget ``kv`` passes ``max_total_tokens`` (the pool's size in tokens: SGLang 0.5.17
    caps the profiled pool at it, ``mem_cache/kv_cache_configurator.py``
    ``_apply_token_constraints``, also after CUDA-graph capture) with mem_fraction_static
    :data:`AUTO_STATIC_FRACTION`: the share is then no reservation, only the ceiling on weights +
    pool against the memory free at start, and 1 - share the room SGLang's start-up check keeps for
    activations and CUDA graphs (its own default on a 141 GB GPU is about 0.93); a small share would
    only cut the pool below the recipe's size. 'auto' without a budget:
    :data:`FALLBACK_STATIC_FRACTION`."""
    if cfg.mem_fraction_static != "auto":
        return {"mem_fraction_static": cfg.mem_fraction_static}
    if kv is None:
        return {"mem_fraction_static": FALLBACK_STATIC_FRACTION}
    return {"mem_fraction_static": AUTO_STATIC_FRACTION, "max_total_tokens": int(kv.tokens)}


def engine_kwargs(cfg: Any, *, model_dir: str, dtype: torch.dtype, seed: int, gpu_id: int,
                  memory: dict[str, Any] | None = None, max_batch_size: int | None = None) -> dict[str, Any]:
    """``sglang.Engine`` (``ServerArgs``) keyword arguments for the plugin's config and a run
    (``memory``: from :func:`memory_kwargs`; default: those of a config without a KV budget;
    ``max_batch_size``: the run's, default the config's)."""
    kw: dict[str, Any] = dict(
        model_path=str(model_dir),
        skip_tokenizer_init=True,
        dtype=dtype_name(dtype),
        random_seed=int(seed),
        base_gpu_id=int(gpu_id),
        enable_memory_saver=True,
        enable_weights_cpu_backup=True,
        incremental_streaming_output=False,
        tp_size=cfg.tensor_parallel_size,
        disable_cuda_graph=not cfg.cuda_graphs,
        log_level=cfg.log_level,
    )
    kw.update(memory if memory is not None else memory_kwargs(cfg))
    if cfg.max_model_len is not None:
        kw["context_length"] = cfg.max_model_len
    batch = max_batch_size if max_batch_size is not None else cfg.max_batch_size
    if batch is not None:
        kw["max_running_requests"] = int(batch)
        if cfg.cuda_graphs and not any(k in cfg.engine_kwargs for k in DECODE_GRAPH_KWARGS):
            kw["cuda_graph_max_bs_decode"] = min(int(batch), DECODE_GRAPH_ROWS_MAX)
    if cfg.use_request_seeds:
        # SGLang reads `sampling_seed` only in deterministic mode (which also picks the pytorch sampler)
        kw["enable_deterministic_inference"] = True
    kw.update(cfg.engine_kwargs)
    return kw


def usable_context(context_len: int, max_req_input_len: int | None = None) -> int:
    """Prompt + response tokens SGLang really serves per sequence (see the module docstring)."""
    limit = int(context_len) - 2
    if max_req_input_len:  # also bounded by the KV pool: max_req_len = max_req_input_len + 5
        limit = min(limit, int(max_req_input_len) + 4)
    return limit


def check_engine_kwargs(extra: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``engine_kwargs`` keys the plugin sets itself."""
    return managed_kwarg_issues(extra, MANAGED_ENGINE_KWARGS)


@dataclass(frozen=True)
class Phase:
    """One SGLang request serving part of an rlcli request.

    ``plugin_stops`` are stop ids SGLang cannot express together with ignoring EOS: the phase
    then streams and the plugin ends the response at the first of them itself.
    """

    sampling: dict[str, Any]
    max_new: int
    plugin_stops: frozenset[int] = frozenset()

    @property
    def stream(self) -> bool:
        return bool(self.plugin_stops)


def _base_sampling(params: SampleParams, seed: int | None) -> dict[str, Any]:
    greedy = params.temperature == 0.0
    kw: dict[str, Any] = dict(
        n=1,
        temperature=0.0 if greedy else float(params.temperature),
        top_p=1.0 if greedy else float(params.top_p),
        top_k=-1 if greedy or params.top_k == 0 else int(params.top_k),
        min_p=0.0,
        repetition_penalty=1.0,
        frequency_penalty=0.0,
        presence_penalty=0.0,
        min_new_tokens=0,
        skip_special_tokens=False,
    )
    if seed is not None:
        kw["sampling_seed"] = int(seed)
    return kw


def plan_phases(params: SampleParams, *, stop_ids: Sequence[int], budget: int, seed: int | None) -> list[Phase]:
    """The SGLang requests that serve one rlcli request (``stop_ids``: EOS unless ignored + stop ids).

    * Stops: without ``ignore_eos`` SGLang stops on ``stop_token_ids`` (the run's EOS ids and the
      request's stop ids). With ``ignore_eos`` SGLang would ignore ``stop_token_ids`` as well, so
      the request's stop ids become plugin-side stops.
    * ``min_tokens``: a first phase of ``min_tokens`` tokens with every stop id at ``-inf`` logit
      bias and no stops, then the rest as a second request continuing ``prompt + phase-1 tokens``
      (SGLang's radix cache reuses the prefix). The ``-inf`` bias also removes the stop ids from the
      logprob normaliser during phase 1, like a min-tokens mask would.
    """
    budget = int(budget)
    stops = [int(t) for t in stop_ids]
    plugin_stops = frozenset(int(t) for t in params.stop_token_ids) if params.ignore_eos else frozenset()
    phases: list[Phase] = []
    min_new = min(int(params.min_tokens), budget)
    if min_new > 0 and stops:
        first = _base_sampling(params, seed)
        first.update(max_new_tokens=min_new, ignore_eos=True, logit_bias={str(t): _NEG_INF for t in stops})
        phases.append(Phase(first, min_new))
        budget -= min_new
        seed = None if seed is None else (int(seed) + 1) & 0x7FFFFFFFFFFFFFFF
    if budget > 0:
        rest = _base_sampling(params, seed)
        rest["max_new_tokens"] = budget
        if params.ignore_eos:
            rest["ignore_eos"] = True
        else:
            rest["ignore_eos"] = False
            rest["stop_token_ids"] = stops
        phases.append(Phase(rest, budget, plugin_stops))
    return phases


def first_stop(token_ids: Sequence[int], stops: frozenset[int]) -> int | None:
    """Index of the first token in ``stops``, or None."""
    for i, t in enumerate(token_ids):
        if t in stops:
            return i
    return None


_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_INT, _FLOAT = frozenset({int}), frozenset({float})


def parse_output(
    out: Mapping[str, Any], with_logprobs: bool = True
) -> tuple[list[int], list[float], str | None, str | None]:
    """``(token_ids, logprobs, finish_type, finish_message)`` of a tokenizer-manager output dict.

    The tokens come from ``meta_info["output_token_logprobs"]`` (``(logprob, token_id, None)``
    entries, cumulative in every output), so tokens and logprobs always pair up. ``output_ids``
    must agree with them: equal on a finished output, a prefix of it may lag on a running stream
    chunk, and the answer to an abort of a queued streamed request holds only the last token.
    ``finish_type`` is None while a streamed request runs. Disagreement raises ``ValueError``.
    Without ``with_logprobs`` (a non-streamed request sent with ``return_logprob`` false, whose
    output has no logprob entries) the tokens are ``output_ids``, all of them in such an output,
    and no logprobs come back.
    """
    meta = out.get("meta_info") or {}
    if not with_logprobs:
        return list(map(int, out.get("output_ids") or [])), [], *_finish_type(meta.get("finish_reason"))
    entries = meta.get("output_token_logprobs") or []
    # whole responses arrive at once: C-level passes (map, type sets), not a Python loop per entry;
    # SGLang's own lists of ints and floats are taken as they are
    values, tokens = list(map(_FIRST, entries)), list(map(_SECOND, entries))
    out_ids = out.get("output_ids") or []
    if not (set(map(type, tokens)) <= _INT and set(map(type, values)) <= _FLOAT
            and type(out_ids) is list and set(map(type, out_ids)) <= _INT):
        if None in values or None in tokens:
            i = next(i for i, (v, t) in enumerate(zip(values, tokens)) if v is None or t is None)
            raise ValueError(f"SGLang returned no logprob for output position {i}: {entries[i]!r}")
        tokens, values, out_ids = list(map(int, tokens)), list(map(float, values)), list(map(int, out_ids))
    ids, lps = tokens, values
    ftype, message = _finish_type(meta.get("finish_reason"))
    n = len(ids)
    if len(out_ids) >= n:
        if ftype is not None and ftype != "abort" and len(out_ids) != n:
            raise ValueError(f"SGLang returned {n} logprobs for {len(out_ids)} tokens")
        mismatch = None if out_ids[:n] == ids else next(i for i in range(n) if out_ids[i] != ids[i])
    elif ftype == "abort" and len(out_ids) <= 1:  # queued stream abort: only the last token
        mismatch = None if not out_ids or out_ids[-1] == ids[-1] else n - 1
    else:
        raise ValueError(f"SGLang returned {n} logprobs for {len(out_ids)} tokens")
    if mismatch is not None:
        raise ValueError(
            f"SGLang logprob entry {mismatch} is for token {ids[mismatch]}, the output has a different token"
        )
    return ids, lps, ftype, message


def _finish_type(reason: Any) -> tuple[str | None, str | None]:
    """``(type, message)`` of a ``meta_info["finish_reason"]`` (a dict, a string or None)."""
    if isinstance(reason, Mapping):
        ftype, message = reason.get("type"), reason.get("message")
    elif isinstance(reason, str):
        ftype, message = reason, None
    else:
        ftype, message = None, None
    return (str(ftype) if ftype is not None else None), (str(message) if message else None)


def batch_outputs(outs: Any, rids: Sequence[str]) -> list[Mapping[str, Any]]:
    """The outputs SGLang yields for a non-streamed batch with these rids, checked: one list, one
    output per rid in batch order (``meta_info["id"]``). Anything else raises ``ValueError``."""
    if not isinstance(outs, list) or len(outs) != len(rids):
        raise ValueError(f"SGLang answered a batch of {len(rids)} requests with {type(outs).__name__} "
                         f"of {len(outs) if isinstance(outs, list) else 'no'} outputs")
    for i, (out, rid) in enumerate(zip(outs, rids)):
        got = (out.get("meta_info") or {}).get("id") if isinstance(out, Mapping) else None
        if got != rid:
            raise ValueError(f"SGLang's batch output {i} is for request {got!r}, not {rid!r}")
    return outs


def finish_reason(ftype: str | None, message: str | None) -> tuple[str, str | None]:
    """The contract's finish reason for an SGLang finish type (before the plugin's abort check)."""
    if ftype in ("stop", "length", "abort"):
        return ftype, message
    return "error", message or f"SGLang finished with {ftype!r}"


def settle_finish(
    reason: str, error: str | None, token_ids: Sequence[int], stop_ids: Sequence[int], budget: int
) -> tuple[str, str | None]:
    """The finish reason the contract wants for a response SGLang ended with ``reason``.

    SGLang checks its length limit before stop tokens and a pending abort before both: a stop id
    sampled as the last allowed token comes back as "length", and a request whose abort landed on
    the step that completed it comes back as "abort". Both are "stop" when the last token is a
    stop id, and a complete aborted response is "length".
    """
    if reason in ("length", "abort") and token_ids:
        if int(token_ids[-1]) in {int(t) for t in stop_ids}:
            return "stop", None
        if reason == "abort" and len(token_ids) >= budget:
            return "length", None
    return reason, error
