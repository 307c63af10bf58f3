"""A CPU stand-in for the vLLM 0.26.0 objects the plugin touches, shaped like the real ones.

Shapes copied from the vLLM 0.26.0 wheel: ``vllm/outputs.py`` (``RequestOutput(request_id, prompt,
prompt_token_ids, prompt_logprobs, outputs, finished)``, ``CompletionOutput(index, text, token_ids,
cumulative_logprob, logprobs, routed_experts, finish_reason, stop_reason)``), ``vllm/logprobs.py``
(``FlatLogprobs(start_indices, end_indices, token_ids, logprobs, ranks, decoded_tokens)``) and the
``vllm/v1/engine/llm_engine.py`` ``LLMEngine`` methods ``add_request``, ``step``, ``abort_request``,
``has_unfinished_requests``, ``sleep``, ``wake_up``, ``collective_rpc``, ``reset_prefix_cache``,
``engine_core.shutdown``, and ``LLMEngine.output_processor`` (``vllm/v1/engine/output_processor.py``:
``external_req_ids`` maps the caller's id to internal ids, ``request_states`` an internal id to a
``RequestState`` with ``detokenizer.output_token_ids`` and ``logprobs_processor.logprobs``). The "model" is a hash of the context plus a weight offset that
``collective_rpc("rlcli_load_weights", ...)`` changes, so updates change outputs.

Behaviour mirrored from vLLM 0.26.0 where the plugin depends on it: ``SamplingParams`` validates
like ``vllm/sampling_params.py`` (``_verify_args``: temperature in [0, 2], top_p in (0, 1],
top_k >= -1, max_tokens >= 1, min_tokens <= max_tokens; unknown fields raise) and clamps
temperatures in (0, 0.01); ``RequestOutputKind`` is an enum; ``abort_request`` yields no output
(``LLMEngine`` has no output queues); the stop check runs before the length check
(``vllm/v1/core/sched/utils.py``); ``sleep``/``wake_up`` follow ``vllm/v1/executor/abstract.py``
(sleeping twice or waking a tag that is awake only warns) and ``CuMemAllocator.wake_up`` (waking
all tags after a partial wake maps the awake memory a second time: an error here); shutting the
engine core down while asleep frees unmapped sleep-mode memory (an error here).
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from rlcli.testing.engine_plugins import cpu_context
from rlcli.testing.engine_plugins import fake_next_token as next_token
from rlcli.testing.engine_plugins import fake_token_logprob as token_logprob

from rlcli_vllm.backend import VLLMBackend


@dataclass
class FlatLogprobs:
    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: Any
    routed_experts: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParams:
    """Records the keyword arguments the plugin passes; validates them like vLLM 0.26.0."""

    FIELDS = {
        "n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
        "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None, "stop": None,
        "stop_token_ids": None, "ignore_eos": False, "max_tokens": 16, "min_tokens": 0, "logprobs": None,
        "prompt_logprobs": None, "flat_logprobs": False, "detokenize": True, "skip_special_tokens": True,
        "spaces_between_special_tokens": True, "include_stop_str_in_output": False,
        "output_kind": RequestOutputKind.CUMULATIVE,
    }

    def __init__(self, **kw):
        unknown = set(kw) - set(self.FIELDS)
        if unknown:
            raise TypeError(f"SamplingParams got unexpected keyword arguments {sorted(unknown)}")
        self.__dict__.update(self.FIELDS)
        self.__dict__.update(kw)
        if 0 < self.temperature < 0.01:
            self.temperature = 0.01
        if self.seed == -1:
            self.seed = None
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not 0 <= self.min_tokens <= (self.max_tokens if self.max_tokens is not None else self.min_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}.")
        if self.logprobs is not None and self.logprobs != -1 and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative or -1, got {self.logprobs}.")
        if not all(isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must contain only integers, got {self.stop_token_ids}.")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.temperature < 1e-5:  # greedy
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0


class FakeLLMEngine:
    """One token per running request per ``step()``; DELTA or FINAL_ONLY outputs with FlatLogprobs
    (all positions so far with FINAL_ONLY, the new one with DELTA)."""

    def __init__(self, vocab: int, step_s: float = 0.002):
        self.vocab = vocab
        self.step_s = step_s
        self.shift = 0
        self.requests: dict[str, dict] = {}
        self.asleep: set[str] = set()
        self.calls: list[tuple] = []
        self.fail_next_step = False
        self.engine_core = SimpleNamespace(shutdown=self._shutdown)
        self.output_processor = SimpleNamespace(external_req_ids={}, request_states={})
        self.thread_ids: set[int] = set()

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id, prompt, params):
        self.thread_ids.add(threading.get_ident())
        assert isinstance(request_id, str)
        assert params.output_kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY)
        assert list(prompt) == ["prompt_token_ids"], prompt  # a TokensPrompt dict
        internal = request_id + "-internal"
        r = {"prompt": list(prompt["prompt_token_ids"]), "sp": params, "gen": [], "flat": FlatLogprobs(),
             "internal": internal}
        self.requests[request_id] = r
        self.output_processor.external_req_ids[request_id] = [internal]
        self.output_processor.request_states[internal] = SimpleNamespace(
            detokenizer=SimpleNamespace(output_token_ids=r["gen"]),
            logprobs_processor=SimpleNamespace(logprobs=r["flat"] if params.logprobs is not None else None))
        self.calls.append(("add_request", request_id))
        return internal

    def _forget(self, rid: str) -> None:
        r = self.requests.pop(rid, None)
        if r is not None:
            self.output_processor.external_req_ids.pop(rid, None)
            self.output_processor.request_states.pop(r["internal"], None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_request(self, request_ids, internal=False):
        self.calls.append(("abort_request", tuple(request_ids)))
        for rid in request_ids:
            self._forget(rid)

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("CUDA error: device-side assert triggered")
        assert "kv_cache" not in self.asleep and "weights" not in self.asleep, "stepped while asleep"
        time.sleep(self.step_s)
        outs = []
        for rid, r in list(self.requests.items()):
            sp = r["sp"]
            stops = getattr(sp, "stop_token_ids", None) or []
            min_tokens = getattr(sp, "min_tokens", 0)
            tok = next_token(r["prompt"] + r["gen"], self.shift, self.vocab)
            n = len(r["gen"])
            if n < min_tokens:
                while tok in stops:
                    tok = (tok + 1) % self.vocab
            r["gen"].append(tok)
            # position holds a non-sampled token first sometimes (rank order), then the sampled one
            flat = FlatLogprobs()
            flat.start_indices.append(0)
            if tok % 3 == 0:
                other = (tok + 1) % self.vocab
                flat.token_ids.append(other)
                flat.logprobs.append(-0.01)
                flat.ranks.append(1)
                flat.decoded_tokens.append(None)
            flat.token_ids.append(tok)
            flat.logprobs.append(token_logprob(tok))
            flat.ranks.append(2)
            flat.decoded_tokens.append(None)
            flat.end_indices.append(len(flat.token_ids))
            acc = r["flat"]  # the request's logprobs so far (the output processor's state)
            base = len(acc.token_ids)
            acc.start_indices.append(base)
            acc.token_ids += flat.token_ids
            acc.logprobs += flat.logprobs
            acc.ranks += flat.ranks
            acc.decoded_tokens += flat.decoded_tokens
            acc.end_indices.append(len(acc.token_ids))
            finish = None
            if tok in stops and n + 1 >= min_tokens:  # vLLM checks stop ids before the length limit
                finish = "stop"
            elif n + 1 >= sp.max_tokens:
                finish = "length"
            if sp.output_kind == RequestOutputKind.FINAL_ONLY:
                if finish is None:
                    continue
                flat = acc if sp.logprobs is not None else None
                ids = list(r["gen"])
            else:
                ids = [tok]
            outs.append(
                RequestOutput(
                    request_id=rid,
                    prompt=None,
                    prompt_token_ids=r["prompt"],
                    prompt_logprobs=None,
                    outputs=[CompletionOutput(0, "", ids, None, flat, finish_reason=finish)],
                    finished=finish is not None,
                )
            )
            if finish is not None:
                self._forget(rid)
        return outs

    # ------------------------------------------------------------------ control
    def sleep(self, level: int = 1, mode: str = "abort"):
        self.calls.append(("sleep", level))
        assert not self.requests, "slept with requests in flight"
        if self.asleep:  # vLLM's executor: "Executor is already sleeping." (warning only)
            return
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", None if tags is None else tuple(tags)))
        if not self.asleep:  # "Executor is not sleeping." (warning only)
            return
        if tags and any(t not in self.asleep for t in tags):  # "Tag ... is not in sleeping tags" (warning only)
            return
        if tags is None and self.asleep != {"weights", "kv_cache"}:
            # CuMemAllocator.wake_up(None) maps every allocation, the awake ones a second time
            raise RuntimeError("CUDA Error: cuMemMap failed (memory already mapped)")
        self.asleep = set() if tags is None else self.asleep - set(tags)

    def _shutdown(self):
        self.calls.append(("shutdown",))
        if self.asleep:
            raise RuntimeError(f"freed sleep-mode memory that is unmapped ({sorted(self.asleep)} asleep)")

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("collective_rpc", method))
        assert method == "rlcli_load_weights"
        assert "weights" not in self.asleep, "loaded weights into offloaded memory"
        (named,) = args
        self.loaded = [name for name, _ in named]
        self.shift = int(sum(float(t.float().sum()) for _, t in named) * 1000) % 9973
        return [len(named)]

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.calls.append(("reset_prefix_cache",))
        return True


class FakeVLLMBackend(VLLMBackend):
    """The plugin's backend over :class:`FakeLLMEngine` (CPU, no vLLM)."""

    requires_cuda = False
    step_s = 0.002

    @staticmethod
    def _load_api():
        return SimpleNamespace(SamplingParams=SamplingParams, RequestOutputKind=RequestOutputKind)

    def _build_engine(self, api):
        self.engine_kw = self._engine_kwargs()  # the EngineArgs the real engine would get
        self.fake = FakeLLMEngine(self.model_info.vocab_size, self.step_s)
        return self.fake, int(self.config.max_model_len or self.model_info.max_position_embeddings)


def context(model_dir, eos: int = 2, version: int = 0, dtype: torch.dtype = torch.float32):
    return cpu_context(model_dir, eos=eos, version=version, dtype=dtype)
