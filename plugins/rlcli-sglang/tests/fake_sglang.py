"""A CPU stand-in for the SGLang 0.5.17 objects the plugin touches, shaped like the real ones.

Shapes read in the SGLang 0.5.17 wheel: ``TokenizerManager.generate_request(obj, request)`` (an
async generator; non-stream yields one final dict, non-incremental stream yields cumulative dicts)
with outputs ``{"output_ids": [...], "meta_info": {"id", "finish_reason", "prompt_tokens",
"completion_tokens", "output_token_logprobs": [(logprob, token_id, None), ...]}}`` (the logprob
entries only when the request has ``return_logprob``) and finish
reasons ``{"type": "stop", "matched": id}`` / ``{"type": "length", "length": n}`` /
``{"type": "abort", "message": ..., "status_code": ..., "err_type": ...}``
(``srt/managers/schedule_batch.py``). As there:

* ``Req.update_finish_state`` order: a pending abort, then the length limit, then stop ids (so a
  stop id sampled as the last allowed token finishes "length"); an abort of a running request
  still decodes one more token; ``ignore_eos`` turns every stop id off; ``logit_bias`` applies
  before sampling;
* ``abort_request(rid)`` of a request that has not started makes ``generate_request`` raise
  ``RequestAbortedError`` (a ``ValueError``); a rid not held (not yet sent, or finished) is
  ignored; with ``abort_echo`` set, the answer to an abort of a streamed request has the shape of
  ``_handle_abort_req`` for a queued request (``output_ids`` only the last token, logprobs
  cumulative);
* a batch (``input_ids`` a list of lists, ``sampling_params`` a dict or a list, ``rid`` a list,
  a string or None), non-streamed: a refused or aborted request before the batch is sent fails
  the whole batch; then one list of the outputs, in order, when all are done; each request keeps
  its rid (``abort_request`` ends it alone);
* ``SamplingParams``: unknown keys raise ``TypeError``; ``top_k`` 0 and ``min_new_tokens > 0``
  (no tokenizer) raise ``ValueError``; ``max_new_tokens`` is clipped to
  ``context_len - 2 - prompt`` and prompts of ``context_len - 6`` tokens or more are refused;
* ``update_weights_from_tensor(obj, None) -> (success, message)``; ``release_memory_occupation`` /
  ``resume_memory_occupation(obj, None)``; ``flush_cache(timeout_s)``; ``context_len``,
  ``max_req_input_len``, ``model_config.hf_eos_token_id``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from rlcli.testing.engine_plugins import cpu_context
from rlcli.testing.engine_plugins import fake_next_token as next_token
from rlcli.testing.engine_plugins import fake_token_logprob as token_logprob

from rlcli_sglang.backend import SGLangBackend

# SamplingParams fields of SGLang 0.5.17 (its msgspec Struct refuses others)
SAMPLING_KEYS = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params",
})


class RequestAbortedError(ValueError):
    """SGLang's tokenizer_manager.RequestAbortedError."""


@dataclass
class GenerateReqInput:
    input_ids: list[int] | list[list[int]]  # a list of lists: a batch
    sampling_params: dict | list[dict]
    return_logprob: bool | list[bool] = False  # a list: one per request of a batch
    stream: bool = False
    rid: str | list[str] | None = None


@dataclass
class UpdateWeightsFromTensorReqInput:
    serialized_named_tensors: list
    load_format: str | None = None
    flush_cache: bool = True


@dataclass
class ReleaseMemoryOccupationReqInput:
    tags: list[str] | None = None


@dataclass
class ResumeMemoryOccupationReqInput:
    tags: list[str] | None = None


class FakeTokenizerManager:
    def __init__(self, vocab: int, context_len: int, step_s: float, eos_ids=()):
        self.vocab, self.context_len, self.step_s = vocab, context_len, step_s
        self.max_req_input_len = context_len - 6  # scheduler: max_req_len - 5, max_req_len = context_len - 1
        self.model_config = SimpleNamespace(hf_eos_token_id=set(eos_ids))
        self.abort_echo = False
        self.shift = 0
        self.aborted: set[str] = set()
        self.released: set[str] = set()
        self.calls: list[tuple] = []
        self.requests: list[GenerateReqInput] = []  # a batch's requests one by one
        self.generate_calls: list[int | None] = []  # per generate_request call: its batch size, None if single
        self.live: set[str] = set()  # rids between generate_request and their end
        self.running = 0
        self.idle_confirmed = False
        self.thread_ids: set[int] = set()
        self._subprocess_watchdog = SimpleNamespace(stop=lambda: self.calls.append(("watchdog_stop",)))

    def _sample(self, ctx: list[int], sp: dict) -> int:
        tok = next_token(ctx, self.shift, self.vocab)
        banned = {int(k) for k, v in (sp.get("logit_bias") or {}).items() if v == float("-inf")}
        while tok in banned:
            tok = (tok + 1) % self.vocab
        return tok

    def _check_sampling(self, obj: GenerateReqInput) -> dict:
        sp = dict(obj.sampling_params)
        unknown = set(sp) - SAMPLING_KEYS
        if unknown:
            raise TypeError(f"Unexpected keyword argument {sorted(unknown)[0]!r}")
        if sp.get("min_new_tokens", 0) > 0:
            raise ValueError(f"min_new_tokens={sp['min_new_tokens']} is unavailable when skip_tokenizer_init=True")
        if sp.get("top_k", -1) == 0 or sp.get("top_k", -1) < -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {sp['top_k']}.")
        n_in, max_new = len(obj.input_ids), sp.get("max_new_tokens", 128)
        if n_in >= self.context_len or n_in + max_new > self.context_len:
            raise ValueError("Requested token count exceeds the model's maximum context length")
        if n_in >= self.max_req_input_len:
            raise ValueError(f"Input length ({n_in} tokens) exceeds the maximum allowed length")  # BAD_REQUEST abort
        sp["max_new_tokens"] = max(0, min(max_new, self.context_len - 1 - n_in - 1))
        return sp

    async def generate_request(self, obj: GenerateReqInput, request: Any = None):
        self.thread_ids.add(threading.get_ident())
        assert request is None
        assert "kv_cache" not in self.released, "served a request with the KV cache released"
        self.idle_confirmed = False
        if obj.input_ids and isinstance(obj.input_ids[0], list):
            async with contextlib.aclosing(self._batch(obj)) as batch:
                async for outs in batch:
                    yield outs
            return
        assert obj.rid
        self.generate_calls.append(None)
        self.requests.append(obj)
        self.live.add(obj.rid)
        try:
            await asyncio.sleep(0)  # tokenization: the first point where an abort can land
            if obj.rid in self.aborted:
                raise RequestAbortedError(f"Request {obj.rid} was aborted")
            async with contextlib.aclosing(self._decode(obj, self._check_sampling(obj))) as outs:
                async for out in outs:
                    yield out
        finally:
            self.live.discard(obj.rid)

    async def _batch(self, obj: GenerateReqInput):
        """A batch as ``_handle_batch_request`` serves it with pre-tokenized input: every request
        checked (one refusal or an abort before sending fails the whole batch), then all decode
        together and one list of the outputs comes back when all are done."""
        assert not obj.stream, "the plugin never streams a batch"
        n = len(obj.input_ids)
        samplings = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params] * n
        if obj.rid is None:
            rids = [f"batch{len(self.generate_calls)}-{i}" for i in range(n)]
        else:
            rids = [f"{obj.rid}_{i}" for i in range(n)] if isinstance(obj.rid, str) else list(obj.rid)
        if len(samplings) != n or len(rids) != n:
            raise ValueError("The specified rids length mismatch with the batch_size for batch processing.")
        lps = obj.return_logprob if isinstance(obj.return_logprob, list) else [obj.return_logprob] * n
        subs = [GenerateReqInput(ids, dict(sp), lp, False, rid)
                for ids, sp, lp, rid in zip(obj.input_ids, samplings, lps, rids)]
        self.generate_calls.append(n)
        self.requests.extend(subs)
        self.live.update(rids)
        try:
            await asyncio.sleep(0)  # tokenization
            for sub in subs:
                if sub.rid in self.aborted:
                    raise RequestAbortedError(f"Request {sub.rid} was aborted")
            checked = [self._check_sampling(sub) for sub in subs]
            yield list(await asyncio.gather(*(self._final(sub, sp) for sub, sp in zip(subs, checked))))
        finally:
            self.live.difference_update(rids)

    async def _decode(self, obj: GenerateReqInput, sp: dict):
        stops = set(sp.get("stop_token_ids") or []) | self.model_config.hf_eos_token_id  # Req.eos_token_ids too
        if sp.get("ignore_eos"):
            stops = set()
        ids, lps, finish = [], [], None
        self.running += 1
        try:
            while finish is None:
                await asyncio.sleep(self.step_s)
                abort = obj.rid in self.aborted  # Req.to_finish: this step still decodes a token
                tok = self._sample(list(obj.input_ids) + ids, sp)
                ids.append(tok)
                lps.append(token_logprob(tok))
                if abort:
                    finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
                elif len(ids) >= sp["max_new_tokens"]:
                    finish = {"type": "length", "length": sp["max_new_tokens"]}
                elif tok in stops:
                    finish = {"type": "stop", "matched": tok}
                if obj.stream and finish is None:
                    yield self._out(obj, ids, lps, None)
            out = self._out(obj, list(ids), list(lps), finish)
            if obj.stream and self.abort_echo and finish["type"] == "abort":
                out["output_ids"] = out["output_ids"][-1:]  # _handle_abort_req for a queued streamed request
            yield out
        finally:
            self.running -= 1

    async def _final(self, obj: GenerateReqInput, sp: dict):
        out = None
        async for out in self._decode(obj, sp):
            pass
        self.live.discard(obj.rid)  # SGLang drops a batch's request state as each one finishes
        return out

    @staticmethod
    def _out(obj, ids, lps, finish):
        meta = {"id": obj.rid, "finish_reason": finish, "prompt_tokens": len(obj.input_ids),
                "completion_tokens": len(ids)}
        if obj.return_logprob:  # TokenizerManager adds the logprob entries only then
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(lps, ids)]
        return {"output_ids": ids, "meta_info": meta}

    def abort_request(self, rid: str = "", abort_all: bool = False):
        self.calls.append(("abort_request", rid))
        if rid in self.live:  # SGLang ignores rids it does not hold (not yet sent, or finished)
            self.aborted.add(rid)

    async def update_weights_from_tensor(self, obj: UpdateWeightsFromTensorReqInput, request: Any = None):
        self.calls.append(("update_weights_from_tensor", obj.flush_cache))
        assert "weights" not in self.released, "updated released weights"
        assert self.running == 0, "weights changed under running requests"
        (named,) = obj.serialized_named_tensors  # the fake serializer is the identity
        self.loaded = [name for name, _ in named]
        self.shift = int(sum(float(t.float().sum()) for _, t in named) * 1000) % 9973
        return True, "Success"

    async def release_memory_occupation(self, obj, request=None):
        assert self.running == 0, "released memory under running requests"
        assert self.idle_confirmed, "released memory before the scheduler was confirmed idle (it would assert)"
        self.calls.append(("release", tuple(obj.tags)))
        self.released |= set(obj.tags)

    async def resume_memory_occupation(self, obj, request=None):
        self.calls.append(("resume", tuple(obj.tags)))
        self.released -= set(obj.tags)

    async def flush_cache(self, timeout_s=None):
        # SGLang 0.5.17: with timeout_s > 0 the scheduler defers the flush until it is fully idle
        self.calls.append(("flush_cache", timeout_s))
        self.idle_confirmed = bool(timeout_s) and self.running == 0
        return SimpleNamespace(success=self.idle_confirmed, message="" if self.idle_confirmed else "busy")


class FakeEngine:
    step_s = 0.002
    vocab = 100
    context_len = 512
    last: "FakeEngine | None" = None

    eos_ids: tuple = ()

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.tokenizer_manager = FakeTokenizerManager(self.vocab, self.context_len, self.step_s, self.eos_ids)
        FakeEngine.last = self

    def get_all_child_pids(self) -> list[int]:
        return []

    def shutdown(self):
        raise AssertionError("the plugin must not call Engine.shutdown() (it kills every child process)")


class FakeSGLangBackend(SGLangBackend):
    """The plugin's backend over :class:`FakeEngine` (CPU, no SGLang)."""

    requires_cuda = False

    def _load_api(self):
        FakeEngine.vocab = self.model_info.vocab_size
        FakeEngine.context_len = int(self.config.max_model_len or self.model_info.max_position_embeddings)
        FakeEngine.eos_ids = tuple(self.ctx.eos_token_ids)
        return SimpleNamespace(
            Engine=FakeEngine,
            GenerateReqInput=GenerateReqInput,
            ReleaseMemoryOccupationReqInput=ReleaseMemoryOccupationReqInput,
            ResumeMemoryOccupationReqInput=ResumeMemoryOccupationReqInput,
            UpdateWeightsFromTensorReqInput=UpdateWeightsFromTensorReqInput,
            serialize=lambda obj: obj,
        )

    @property
    def tm(self) -> FakeTokenizerManager:
        return self._tm


def context(model_dir, eos: int = 2, version: int = 0, dtype: torch.dtype = torch.bfloat16):
    return cpu_context(model_dir, eos=eos, version=version, dtype=dtype)
