"""A CPU stand-in for the LMDeploy 0.18.0 objects the plugin touches, shaped like the real ones.

Shapes copied from the LMDeploy 0.18.0 wheel: ``lmdeploy/messages.py`` (``ResponseType`` members,
``EngineOutput(status, token_ids, logprobs, ...)`` with ``logprobs: list[dict[int, float]]``, the
sampled token first), ``lmdeploy/pytorch/engine/engine_instance.py``
(``async_stream_infer(session_id, input_ids, gen_config)`` yielding ``SUCCESS`` deltas then
``FINISH``/``CANCEL``; ``async_cancel(session_id)``), ``lmdeploy/pytorch/engine/engine.py``
(``from_pretrained``, ``start_loop``, ``create_instance``, ``async sleep(level)``,
``wakeup(tags)``, ``close``, ``max_session_len``, ``engine_config``, ``executor.model_agent``)
and ``model_agent/agent.py`` (``all_context``, ``_load_updated_weight_bucket``,
``_finalize_updated_weights``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import threading
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

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


class Recorder:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def next_token(context: list[int], shift: int, vocab: int) -> int:
    h = shift
    for t in context[-4:]:
        h = (h * 1_000_003 + t + 7) % 2_147_483_647
    return h % vocab


def token_logprob(tok: int) -> float:
    return -0.05 * (1 + tok % 13)


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


class FakeInstance:
    def __init__(self, engine: "FakeEngine"):
        self.engine = engine
        self.cancelled: set[int] = set()

    async def async_stream_infer(self, session_id, input_ids, gen_config=None, **kwargs):
        eng = self.engine
        eng.thread_ids.add(threading.get_ident())
        assert not eng.asleep, "served a request while asleep"
        eng.requests.append((session_id, list(input_ids), gen_config))
        # LMDeploy's ignore_eos turns the stop ids into banned ids (the plugin never sets it)
        stops = set() if gen_config.ignore_eos else set(gen_config.stop_token_ids or [])
        assert gen_config.logprobs >= 1
        gen: list[int] = []
        eng.running += 1
        try:
            while True:
                await asyncio.sleep(eng.step_s)
                if session_id in self.cancelled:
                    if eng.cancel_with_unscored_token:
                        tok = next_token(list(input_ids) + gen, eng.shift, eng.vocab)
                        yield EngineOutput(ResponseType.CANCEL, [tok], None)
                    else:
                        yield EngineOutput(ResponseType.CANCEL, [], None)
                    return
                tok = next_token(list(input_ids) + gen, eng.shift, eng.vocab)
                if len(gen) < (gen_config.min_new_tokens or 0):
                    while tok in stops:
                        tok = (tok + 1) % eng.vocab
                gen.append(tok)
                lp = {tok: token_logprob(tok), (tok + 1) % eng.vocab: -0.01}
                if tok in stops or len(gen) >= gen_config.max_new_tokens:
                    yield EngineOutput(ResponseType.FINISH, [tok], [lp])
                    return
                yield EngineOutput(ResponseType.SUCCESS, [tok], [lp])
        finally:
            eng.running -= 1
            eng.ended.append(session_id)

    async def async_cancel(self, session_id):
        self.engine.calls.append(("cancel", session_id))
        self.cancelled.add(session_id)
        return ResponseType.SUCCESS


class FakeEngine:
    vocab = 100
    session_len = 512
    step_s = 0.002

    def __init__(self, model_path, engine_config):
        self.model_path, self.engine_config = model_path, engine_config
        self.executor = SimpleNamespace(model_agent=FakeAgent(self))
        self.max_session_len = engine_config.__dict__.get("session_len") or self.session_len
        if getattr(engine_config, "max_batch_size", None) is None:
            engine_config.max_batch_size = 8
        self.calls: list[tuple] = []
        self.requests: list[tuple] = []
        self.ended: list[int] = []
        self.asleep: set[str] = set()
        self.shift = 0
        self.running = 0
        self.thread_ids: set[int] = set()
        self.cancel_with_unscored_token = False
        self._loop_main = None

    @classmethod
    def from_pretrained(cls, path, engine_config=None, **kw):
        return cls(path, engine_config)

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


class FakeLMDeployBackend(LMDeployBackend):
    """The plugin's backend over :class:`FakeEngine` (CPU, no LMDeploy)."""

    requires_cuda = False

    def _load_api(self):
        FakeEngine.vocab = self.model_info.vocab_size
        FakeEngine.session_len = int(self.config.max_model_len or self.model_info.max_position_embeddings)
        return SimpleNamespace(Engine=FakeEngine, GenerationConfig=Recorder, PytorchEngineConfig=Recorder)

    @property
    def fake(self) -> FakeEngine:
        return self._lmd


def context(model_dir, eos: int = 2, version: int = 0, dtype=torch.bfloat16):
    from rlcli.backends.base import BackendContext

    return BackendContext(model_dir=str(model_dir), device=torch.device("cpu"), dtype=dtype,
                          eos_token_ids=[eos], seed=0, version=version)
