"""A CPU stand-in for the LMDeploy 0.18.0 objects the plugin touches, shaped like the real ones.

Shapes read from the LMDeploy 0.18.0 wheel (written here, not copied):

* ``lmdeploy/messages.py``: ``ResponseType`` members; ``EngineOutput(status, token_ids, logprobs,
  ...)`` with ``logprobs: list[dict[int, float]]`` (sampled token first); ``GenerationConfig`` and
  ``PytorchEngineConfig`` are dataclasses (unknown fields raise ``TypeError``, ``__post_init__``
  asserts: top_k >= 0, temperature in [0, 2], dtype in auto/float16/bfloat16,
  0 < cache_max_entry_count < 1).
* ``lmdeploy/pytorch/engine/engine_instance.py``: ``async_stream_infer(session_id, input_ids,
  gen_config)`` yields ``SUCCESS`` deltas, several tokens at once when the reader lags (the engine
  keeps one response object per request and overwrites it), then ``FINISH`` or ``CANCEL`` with the
  tokens not yet read and their logprobs; closing the stream ends the session;
  ``async_cancel(session_id)`` returns None. ``logprobs`` stay None unless the engine was built
  with a ``logprobs_mode`` and the request asks for ``logprobs >= 1``.
* ``lmdeploy/pytorch/engine/engine.py``: ``from_pretrained``, ``start_loop``, ``create_instance``,
  ``async sleep(level)``, ``wakeup(tags)`` (sync), ``close``, ``max_session_len`` (``session_len``
  cut to the KV cache; the KV cache's size when ``session_len`` is None), ``engine_config``,
  ``executor.model_agent``; the engine runs ``lmdeploy.pytorch.envs.enable_check_env``'s check at
  construction and calls ``exit(1)`` when it fails.
* ``model_agent/agent.py``: ``all_context``, ``_load_updated_weight_bucket``,
  ``_finalize_updated_weights``, ``get_logits`` (the lm-head output, in the model's dtype).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from rlcli.testing.engine_plugins import cpu_context
from rlcli.testing.engine_plugins import fake_next_token as next_token
from rlcli.testing.engine_plugins import fake_token_logprob as token_logprob

from rlcli_lmdeploy.backend import LMDeployBackend


class ResponseType(enum.Enum):
    SUCCESS = enum.auto()
    FINISH = enum.auto()
    ENGINE_STOP_ERROR = enum.auto()
    SESSION_REPEAT = enum.auto()
    SESSION_NOT_EXIST = enum.auto()
    HANDLER_NOT_EXIST = enum.auto()
    INPUT_LENGTH_ERROR = enum.auto()
    INTERNAL_ENGINE_ERROR = enum.auto()
    CANCEL = enum.auto()
    PREFIX_CACHE_CONFLICT = enum.auto()
    NO_QUEUE = enum.auto()
    NOT_SUPPORTED = enum.auto()
    OUT_OF_MEMORY = enum.auto()


@dataclass
class EngineOutput:
    status: ResponseType
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    logits: Any = None
    last_hidden_state: Any = None
    cache_block_ids: Any = None
    req_metrics: Any = None
    routed_experts: Any = None
    ce_loss: float | None = None


@dataclass
class GenerationConfig:
    """The ``lmdeploy.GenerationConfig`` fields the plugin and benchmarks/backends.py set, with
    LMDeploy's defaults and checks."""

    n: int = 1
    max_new_tokens: int = 512
    do_sample: bool = False
    top_p: float = 1.0
    top_k: int = 50
    min_p: float = 0.0
    temperature: float = 0.8
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    random_seed: int | None = None
    stop_token_ids: list[int] | None = None
    bad_token_ids: list[int] | None = None
    min_new_tokens: int | None = None
    skip_special_tokens: bool = True
    logprobs: int | None = None

    def __post_init__(self):
        assert isinstance(self.n, int) and self.n > 0
        assert 0 <= self.top_p <= 1
        assert self.top_k >= 0, "top_k can not be a negative integer"
        assert 0 <= self.temperature <= 2
        assert 0 <= self.min_p <= 1


@dataclass
class PytorchEngineConfig:
    """The ``lmdeploy.PytorchEngineConfig`` fields the plugin sets (plus two engine_kwargs
    examples), with LMDeploy's defaults and checks."""

    dtype: str = "auto"
    tp: int = 1
    session_len: int | None = None
    max_batch_size: int | None = None
    cache_max_entry_count: float = 0.8
    block_size: int = 64
    num_gpu_blocks: int = 0
    max_prefill_token_num: int = 8192
    enable_prefix_caching: bool = False
    device_type: str = "cuda"
    eager_mode: bool = False
    distributed_executor_backend: str | None = None
    empty_init: bool = False
    enable_mp_engine: bool = False
    logprobs_mode: str | None = None
    hf_overrides: dict | None = None

    def __post_init__(self):
        assert self.dtype in ("auto", "float16", "bfloat16")
        assert 0 < self.cache_max_entry_count < 1, "invalid cache_max_entry_count"
        assert self.num_gpu_blocks >= 0, "invalid num_gpu_blocks"
        assert self.device_type in ("cuda", "ascend", "maca", "camb")


class FakeAgent:
    def __init__(self, engine: "FakeEngine"):
        self.engine = engine
        self.in_context = False

    @contextlib.contextmanager
    def all_context(self):
        self.in_context = True
        try:
            yield
        finally:
            self.in_context = False

    def _load_updated_weight_bucket(self, weights, op_name):
        assert self.in_context and "weights" not in self.engine.asleep, "loaded into offloaded weights"
        assert self.engine.running == 0, "weights changed under running requests"
        self.engine.calls.append(("load", op_name))
        self.engine.loaded = [name for name, _ in weights]
        self.engine.shift = int(sum(float(t.float().sum()) for _, t in weights) * 1000) % 9973

    def _finalize_updated_weights(self):
        assert self.in_context
        self.engine.calls.append(("finalize",))

    def get_logits(self, hidden_states):
        return hidden_states.to(torch.bfloat16)  # a bfloat16 model's lm head


class FakeInstance:
    def __init__(self, engine: "FakeEngine"):
        self.engine = engine

    async def async_stream_infer(self, session_id, input_ids, gen_config=None, **kwargs):
        eng = self.engine
        eng.thread_ids.add(threading.get_ident())
        assert not eng.asleep, "served a request while asleep"
        assert session_id not in eng.sessions, f"session {session_id} is already running"
        if len(input_ids) > eng.max_session_len:
            yield EngineOutput(ResponseType.INPUT_LENGTH_ERROR, [])
            return
        gen_config = gen_config or GenerationConfig()
        eng.requests.append((session_id, list(input_ids), gen_config))
        # LMDeploy's ignore_eos turns the stop ids into banned ids (the plugin never sets it)
        stops = set() if gen_config.ignore_eos else set(gen_config.stop_token_ids or [])
        with_logprobs = eng.engine_config.logprobs_mode is not None and (gen_config.logprobs or 0) >= 1
        max_new = min(gen_config.max_new_tokens, eng.max_session_len - len(input_ids))
        min_new = gen_config.min_new_tokens or 0
        if min_new > max_new:
            min_new = 0
        gen: list[int] = []
        unread: list[int] = []  # generated, not yet handed to the reader (one response object, overwritten)
        eng.sessions[session_id] = "running"
        eng.running += 1

        def out(status, tokens):
            lps = [{t: token_logprob(t), (t + 1) % eng.vocab: -0.01} for t in tokens] if with_logprobs else None
            if lps and eng.drop_logprob_of_step == step:  # a malformed output: a position lacks its token
                lps[-1] = {(tokens[-1] + 1) % eng.vocab: -0.01}
            return EngineOutput(status, list(tokens), lps)

        try:
            step = 0
            while True:
                await asyncio.sleep(eng.step_s)
                if eng.sessions.get(session_id) == "stopped":
                    if eng.cancel_with_unscored_token:
                        tok = next_token(list(input_ids) + gen, eng.shift, eng.vocab)
                        yield EngineOutput(ResponseType.CANCEL, unread + [tok], None)
                    else:
                        yield out(ResponseType.CANCEL, unread)
                    return
                tok = next_token(list(input_ids) + gen, eng.shift, eng.vocab)
                if len(gen) < min_new:
                    while tok in stops:
                        tok = (tok + 1) % eng.vocab
                gen.append(tok)
                unread.append(tok)
                step += 1
                if tok in stops or len(gen) >= max_new:
                    yield out(ResponseType.FINISH, unread)
                    return
                if step % eng.read_every == 0:  # the reader missed read_every - 1 updates
                    yield out(ResponseType.SUCCESS, unread)
                    unread = []
        finally:
            eng.running -= 1
            eng.sessions.pop(session_id, None)
            eng.ended.append(session_id)  # async_end(session_id) of the stream's own cleanup

    async def async_cancel(self, session_id):
        self.engine.calls.append(("cancel", session_id))
        if session_id in self.engine.sessions:
            self.engine.sessions[session_id] = "stopped"
        return None


class FakeEngine:
    vocab = 100
    kv_tokens = 1_000_000  # what the KV cache holds
    step_s = 0.002
    read_every = 1
    drop_logprob_of_step: int | None = None  # that step's output lacks the sampled token's logprob
    check_env_fails = False
    env_checks = 0

    def __init__(self, model_path, engine_config):
        self.model_path = model_path
        self.engine_config = dataclasses.replace(engine_config)  # LMDeploy keeps a copy
        if self.engine_config.enable_mp_engine or self.engine_config.distributed_executor_backend not in ("uni", None):
            raise AssertionError("the plugin must build the in-process uni executor")
        if ENVS.enable_check_env:
            type(self).env_checks += 1
            if self.check_env_fails:
                raise SystemExit(1)  # LMDeploy's checkers log and call exit(1)
        self.executor = SimpleNamespace(model_agent=FakeAgent(self))
        session_len = self.engine_config.session_len
        # Engine._get_max_session_len: (num_gpu_blocks - 1 reserved) blocks, less one block
        blocks, size = self.engine_config.num_gpu_blocks, self.engine_config.block_size
        kv_tokens = (blocks - 1) * size - size if blocks else self.kv_tokens
        self.max_session_len = min(session_len, kv_tokens) if session_len else kv_tokens
        if self.engine_config.max_batch_size is None:
            self.engine_config.max_batch_size = 8
        self.calls: list[tuple] = []
        self.requests: list[tuple] = []
        self.ended: list[int] = []
        self.sessions: dict[int, str] = {}
        self.asleep: set[str] = set()
        self.shift = 0
        self.running = 0
        self.thread_ids: set[int] = set()
        self.cancel_with_unscored_token = False
        self._loop_main = None

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, engine_config=None, speculative_config=None,
                        trust_remote_code=False, **kw):
        return cls(pretrained_model_name_or_path, engine_config or PytorchEngineConfig())

    def start_loop(self):
        async def main_loop():
            await asyncio.Event().wait()

        self._loop_main = asyncio.get_running_loop().create_task(main_loop())
        self.calls.append(("start_loop",))
        return True

    def create_instance(self, cuda_stream_id=0):
        return FakeInstance(self)

    async def sleep(self, level: int = 1):
        assert self.running == 0
        self.calls.append(("sleep", level))
        self.asleep = {"weights", "kv_cache"}

    def wakeup(self, tags=None):
        self.calls.append(("wakeup", None if tags is None else tuple(tags)))
        self.asleep = set() if tags is None else self.asleep - set(tags)

    def close(self):
        self.calls.append(("close",))
        if self._loop_main is not None:
            self._loop_main.cancel()


ENVS = SimpleNamespace(enable_check_env=True)  # lmdeploy.pytorch.envs


class FakeLMDeployBackend(LMDeployBackend):
    """The plugin's backend over :class:`FakeEngine` (CPU, no LMDeploy)."""

    requires_cuda = False

    def _load_api(self):
        FakeEngine.vocab = self.model_info.vocab_size
        return SimpleNamespace(Engine=FakeEngine, GenerationConfig=GenerationConfig,
                               PytorchEngineConfig=PytorchEngineConfig, envs=ENVS)

    @property
    def fake(self) -> FakeEngine:
        return self._lmd


def context(model_dir, eos: int = 2, version: int = 0, dtype: torch.dtype = torch.bfloat16):
    return cpu_context(model_dir, eos=eos, version=version, dtype=dtype)
