"""The backend: :class:`EngineBackend`, the contract's state machine around the ``_engine_*``
hooks (see :mod:`rlcli.backends.engine_runtime`), and :class:`Job`, one request on its way
through an engine."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Sequence

import torch

from rlcli.backends.base import BackendContext, GenerateOutput, GenerateRequest, InferenceBackend
from rlcli.backends.engine_runtime.helpers import (
    SeedSequence,
    normalize_finish,
    prepare_weight_update,
    response_budget,
    stop_ids_for,
    validate_request,
)
from rlcli.backends.engine_runtime.kv_budget import KVBudget, plan_kv_cache
from rlcli.backends.engine_runtime.loop import EngineLoop
from rlcli.backends.engine_runtime.relay import EngineStopped, Relay
from rlcli.backends.engine_runtime.model_info import read_model_info
from rlcli.backends.engine_runtime.package import EnginePackage, managed_kwarg_issues
from rlcli.types import SampleParams

log = logging.getLogger(__package__)  # "rlcli.backends.engine_runtime", as before the split
# the most sequences an engine plugin decodes together when its max_batch_size is unset (EngineBackend.max_batch_size)
AUTO_MAX_BATCH = 1024
_PLAIN_NUMBERS = frozenset({float, int})  # Job.add's fast check: logprobs of exactly these types
_INTS, _FLOATS = frozenset({int}), frozenset({float})


@dataclass
class Job:
    """One request on its way through an engine; the engine hook appends tokens as they arrive."""

    rid: str
    prompt: list[int]
    params: SampleParams
    seed: int | None
    stop_ids: list[int]
    budget: int  # max new tokens after the context-length cut
    version: int  # policy version of the weights serving it (stamped at admission)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    aborted: bool = False  # the plugin asked the engine to end it early
    handle: Any = None  # engine-specific (request id of the current phase, session, ...)

    def add(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        """Append the engine's new tokens and their logprobs; a request whose ``return_logprob`` is
        false keeps none (whether the engine skipped them or returned them anyway)."""
        if not self.params.return_logprob:
            self.token_ids.extend(int(t) for t in token_ids)
            return
        if len(token_ids) != len(logprobs):
            raise RuntimeError(f"the engine returned {len(logprobs)} logprobs for {len(token_ids)} tokens")
        # A non-streamed response arrives whole (256+ values): check it with C-level passes (types,
        # then a sum that any NaN turns into NaN), and look value by value only when that check fails.
        types = set(map(type, logprobs))
        if not (types <= _PLAIN_NUMBERS and not math.isnan(sum(logprobs))):
            for lp in logprobs:
                if not isinstance(lp, (int, float)) or math.isnan(lp):
                    raise RuntimeError(f"the engine returned an invalid logprob {lp!r}")
        # lists of plain ints and floats are taken as they are; anything else is converted
        plain_ids = type(token_ids) is list and set(map(type, token_ids)) <= _INTS
        self.token_ids.extend(token_ids if plain_ids else map(int, token_ids))
        self.logprobs.extend(logprobs if types <= _FLOATS else map(float, logprobs))


class EngineBackend(InferenceBackend, abc.ABC):
    """Base of the engine plugins' backends: the contract's state machine around ``_engine_*`` hooks.

    Subclasses set ``name``, ``Config``, ``engine`` (an :class:`EnginePackage`) and implement the
    hooks; they may override :meth:`_resolve_max_model_len` and :meth:`_request_problem`.
    """

    engine: ClassVar[EnginePackage]
    managed_engine_kwargs: ClassVar[dict[str, str]] = {}  # engine kwargs the plugin sets itself -> why
    requires_cuda: ClassVar[bool] = True
    startup_timeout_s: ClassVar[float | None] = None  # engine start-up can take minutes (compilation)
    shutdown_timeout_s: ClassVar[float] = 120.0
    # Set when the engine cannot serve float32 models: the reason, refused in `rlcli validate`
    # (model.dtype) and before the engine is built.
    float32_refusal: ClassVar[str | None] = None

    @classmethod
    def check_config(cls, cfg) -> list[tuple[str, str]]:
        """``rlcli validate``: the engine must be importable, ``engine_kwargs`` must not override
        what the plugin sets itself, plus :meth:`extra_config_issues`."""
        issues = []
        problem = cls.engine.problem()
        if problem is not None:
            issues.append(("name", problem))
        issues += managed_kwarg_issues(getattr(cfg, "engine_kwargs", {}) or {}, cls.managed_engine_kwargs)
        return issues + cls.extra_config_issues(cfg)

    @classmethod
    def extra_config_issues(cls, cfg) -> list[tuple[str, str]]:
        """Engine-specific option checks (``(field, message)`` pairs); none by default."""
        return []

    def __init__(self, config, ctx: BackendContext):
        super().__init__(config, ctx)
        device = torch.device(ctx.device)
        if self.requires_cuda and device.type != "cuda":
            raise ValueError(
                f"the {self.engine.label} backend runs on CUDA GPUs; this run's device is {device} "
                f"(use rollout.name=embedded on CPU)"
            )
        problem = self.engine.problem() if self.requires_cuda else None
        if problem is not None:
            raise RuntimeError(problem)
        if self.float32_refusal and ctx.dtype == torch.float32:
            raise ValueError(self.float32_refusal)
        self.model_info = read_model_info(ctx.model_dir)
        self.max_model_len: int | None = self._resolve_max_model_len()
        self.max_batch_size: int | None = self._resolve_max_batch_size()
        self.kv_plan: KVBudget | None = None  # the KV cache sized from the workload (kv_budget), if any
        self._version = int(ctx.version)
        self._paused = False
        self._closed = False
        self._asleep = 0
        self._updating = False
        self._inflight: dict[str, Job] = {}
        self._waiting = 0
        self._ids = itertools.count()
        self._seeds = SeedSequence(ctx.seed, ctx.rank)
        self._use_seeds = bool(getattr(self.config, "use_request_seeds", True))
        self._stats_lock = threading.Lock()
        self._counters: dict[str, float] = self._zero_counters()
        self._busy_since: float | None = None
        self._caveats_logged: set[str] = set()
        self._gate: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._loop = EngineLoop(f"rlcli-{self.name}")
        self._relay = Relay(self._loop)  # requests and their results cross threads once per loop turn
        self._loop.start()
        try:
            self._loop.call(self._startup(), timeout=self.startup_timeout_s)
        except BaseException:
            self._closed = True
            self._loop.stop()
            raise

    # -------------------------------------------------------------------------- recipe checks
    @classmethod
    def check_recipe(cls, recipe: Any) -> list[tuple[str, str]]:
        """``rlcli validate``: problems of a recipe whose inference backend is this one."""
        if getattr(getattr(recipe, "rollout", None), "name", None) != cls.name:
            return []
        issues = []
        if cls.requires_cuda and getattr(getattr(recipe, "resources", None), "device", "auto") == "cpu":
            issues.append(("resources.device", f"the {cls.engine.label} backend runs on CUDA GPUs, not on the CPU "
                                               f"(use rollout.name=embedded there)"))
        if cls.float32_refusal and getattr(getattr(recipe, "model", None), "dtype", "auto") == "float32":
            issues.append(("model.dtype", cls.float32_refusal))
        return issues + cls._check_recipe(recipe)

    @classmethod
    def _check_recipe(cls, recipe: Any) -> list[tuple[str, str]]:
        """Engine-specific recipe problems (the inference backend is this one)."""
        return []

    # -------------------------------------------------------------------------- hooks
    def _resolve_max_model_len(self) -> int | None:
        """Prompt + response tokens per sequence (before the engine starts; the engine may refine it)."""
        return getattr(self.config, "max_model_len", None) or self.model_info.max_position_embeddings

    def _resolve_max_batch_size(self) -> int | None:
        """Sequences the engine decodes together: the plugin's ``max_batch_size`` when set, else the
        run's sequences in flight (``ctx.workload.max_sequences``, so that one step's rollout is one
        wave, not several at the engine's own default), at most :data:`AUTO_MAX_BATCH` (an eval set
        of thousands of prompts would otherwise ask the engines for CUDA graphs and request slots
        by the thousand); None when neither is known (the engine's default then)."""
        configured = getattr(self.config, "max_batch_size", None)
        if configured is not None:
            return int(configured)
        workload = self.ctx.workload
        return min(int(workload.max_sequences), AUTO_MAX_BATCH) if workload is not None else None

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's weights in the run's dtype (tied weights once)."""
        return sum(math.prod(shape) for name, shape in self.model_info.shapes.items()
                   if name not in self.model_info.aliases) * self.ctx.dtype.itemsize

    def kv_budget(self, *, block_size: int, reserved_blocks: int = 0,
                  dtype_bytes: int | None = None) -> KVBudget | None:
        """The KV cache the run's workload (``ctx.workload``) needs in this engine (see
        :mod:`~rlcli.backends.engine_runtime.kv_budget`), at most :attr:`max_batch_size` sequences
        of it, logged; None when the workload is unknown. ``dtype_bytes``: of the KV cache
        (default: the model dtype's)."""
        if self.model_info.kv_shape is None:
            self.kv_plan = None
            log.info("%s backend: the model's config names no layer and head counts; the engine sizes its KV "
                     "cache itself", self.engine.label)
            return None
        device = torch.device(self.ctx.device)
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" and torch.cuda.is_available() else None
        budget = plan_kv_cache(self.ctx.workload, self.model_info.kv_shape,
                               dtype_bytes=dtype_bytes or self.ctx.dtype.itemsize, block_size=block_size,
                               max_model_len=self.max_model_len, concurrency=self.max_batch_size,
                               reserved_blocks=reserved_blocks, free_bytes=free, weight_bytes=self.weight_bytes)
        self.kv_plan = budget
        if budget is None:
            log.info("%s backend: the workload is unknown; the engine sizes its KV cache itself", self.engine.label)
        elif budget.capped_blocks is not None:
            log.warning("%s backend: KV cache of %s; set rollout.max_batch_size or a memory share to size it "
                        "yourself", self.engine.label, budget.describe())
        else:
            log.info("%s backend: KV cache sized from the recipe: %s", self.engine.label, budget.describe())
        return budget

    def _request_problem(self, params: SampleParams) -> str | None:
        """Engine-specific reasons to refuse a request's parameters (an ``error`` message)."""
        return None

    def _logprob_caveat(self, params: SampleParams) -> str | None:
        """Why this engine's logprobs for ``params`` are not ``log_softmax(logits / T)`` (logged once)."""
        return None

    @abc.abstractmethod
    async def _engine_start(self) -> None:
        """Build and start the engine (on the engine loop)."""

    @abc.abstractmethod
    async def _engine_generate(self, job: Job) -> tuple[str, str | None]:
        """Serve ``job``: append tokens and logprobs to it as they arrive; return ``(finish, error)``
        with finish one of "stop", "length", "abort", "error". Must return promptly after
        :meth:`_engine_abort` named the job."""

    @abc.abstractmethod
    async def _engine_abort(self, jobs: list[Job]) -> None:
        """Ask the engine to end these in-flight jobs now (their ``aborted`` flag is already set)."""

    @abc.abstractmethod
    async def _engine_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load checked Hugging Face-named tensors (no request in flight; maybe asleep)."""

    @abc.abstractmethod
    async def _engine_sleep(self, level: int) -> None:
        """Release device memory (no request in flight)."""

    @abc.abstractmethod
    async def _engine_wake_up(self) -> None:
        """Restore what :meth:`_engine_sleep` released."""

    @abc.abstractmethod
    async def _engine_shutdown(self) -> None:
        """Free the engine (every job has ended)."""

    def _engine_stats(self) -> dict[str, float]:
        return {}

    # -------------------------------------------------------------------------- state
    @property
    def version(self) -> int:
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def asleep(self) -> int:
        return self._asleep

    async def _startup(self) -> None:
        self._gate = asyncio.Event()
        self._gate.set()
        self._idle = asyncio.Event()
        self._idle.set()
        await self._engine_start()

    def _refresh_gate(self) -> None:
        if self._closed or (not self._asleep and not self._updating):
            self._gate.set()
        else:
            self._gate.clear()

    # -------------------------------------------------------------------------- generate
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Generate a response; see :mod:`rlcli.backends.base` for the contract.

        Invalid requests return ``finish_reason="error"`` with the reason in ``error``.
        """
        if self._closed:
            return GenerateOutput(finish_reason="error", error=f"the {self.name} backend is shut down")
        problem = validate_request(request, self.model_info.vocab_size, self.max_model_len)
        if problem is None:
            problem = self._request_problem(request.params)
        if problem is not None:
            return GenerateOutput(finish_reason="error", error=problem)
        if self._paused:
            return GenerateOutput(finish_reason="abort")
        try:
            return await self._relay.run(lambda: self._generate(request))
        except EngineStopped as exc:
            return GenerateOutput(finish_reason="error", error=str(exc))

    async def _generate(self, request: GenerateRequest) -> GenerateOutput:
        if not self._gate.is_set():
            self._waiting += 1
            try:
                while not self._gate.is_set():
                    await self._gate.wait()
            finally:
                self._waiting -= 1
        if self._closed:
            return GenerateOutput(finish_reason="error", error=f"the {self.name} backend is shut down")
        if self._paused:
            return GenerateOutput(finish_reason="abort")
        params = request.params
        caveat = self._logprob_caveat(params)
        if caveat is not None and caveat not in self._caveats_logged:
            self._caveats_logged.add(caveat)
            log.warning("%s backend: %s", self.name, caveat)
        prompt = list(map(int, request.prompt_ids))
        job = Job(
            rid=f"rlcli-{next(self._ids)}",
            prompt=prompt,
            params=params,
            seed=self._seeds(request.seed) if self._use_seeds else None,
            stop_ids=stop_ids_for(params, self.ctx.eos_token_ids),
            budget=response_budget(params, len(prompt), self.max_model_len),
            version=self._version,
        )
        self._begin(job)
        try:
            reason, error = await self._engine_generate(job)
        except asyncio.CancelledError:
            if not job.aborted and not self._closed:
                job.aborted = True
                try:
                    await self._engine_abort([job])
                except Exception:
                    log.debug("abort of a cancelled request failed", exc_info=True)
            raise
        except Exception as exc:  # an engine failure ends this request, never the caller
            log.exception("%s engine failed on request %s", self.name, job.rid)
            reason, error = "error", f"{type(exc).__name__}: {exc}"
        finally:
            self._end(job)
        finish, error = normalize_finish(reason, error, job.aborted)
        tokens, logprobs = job.token_ids, job.logprobs
        if len(tokens) > job.budget:  # never more than asked, whatever the engine did
            tokens, logprobs, finish = tokens[: job.budget], logprobs[: job.budget], "length"
        self._count(finish, len(tokens))
        return GenerateOutput(
            token_ids=tokens,
            logprobs=logprobs,
            versions=[job.version] * len(tokens),
            finish_reason=finish,
            error=error,
        )

    def _begin(self, job: Job) -> None:
        self._inflight[job.rid] = job
        self._idle.clear()
        with self._stats_lock:
            if self._busy_since is None:
                self._busy_since = time.perf_counter()

    def _end(self, job: Job) -> None:
        self._inflight.pop(job.rid, None)
        if not self._inflight:
            self._idle.set()
            with self._stats_lock:
                if self._busy_since is not None:
                    self._counters["busy_s"] += time.perf_counter() - self._busy_since
                self._busy_since = None

    async def _abort_inflight(self) -> None:
        jobs = [j for j in self._inflight.values() if not j.aborted]
        for j in jobs:
            j.aborted = True
        if jobs:
            await self._engine_abort(jobs)

    async def _drain(self, timeout: float | None = None) -> None:
        if timeout is None:
            await self._idle.wait()
        else:
            await asyncio.wait_for(self._idle.wait(), timeout)

    # -------------------------------------------------------------------------- control
    def pause(self) -> None:
        """Abort every in-flight request (finish "abort", tokens so far) and refuse new ones."""
        self._paused = True
        if self._closed:
            return
        self._loop.call(self._abort_inflight())

    def resume(self) -> None:
        """Accept requests again after :meth:`pause`."""
        self._paused = False

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load Hugging Face-named tensors (any subset) and make ``version`` the policy version.

        Unknown names or wrong shapes raise ``ValueError`` before anything changes. New requests
        wait; requests in flight finish on the old weights first (``pause()`` first to cut them
        short); then the tensors load and the gate reopens. Works asleep too.
        """
        if self._closed:
            raise RuntimeError(f"the {self.name} backend is shut down")
        items = prepare_weight_update(named_tensors, self.model_info)
        self._loop.call(self._update(items, int(version)))

    async def _update(self, items: list[tuple[str, torch.Tensor]], version: int) -> None:
        self._updating = True
        self._refresh_gate()
        try:
            await self._drain()
            t0 = time.perf_counter()
            await self._engine_load_weights(items)
            self._version = version
            with self._stats_lock:
                self._counters["weight_updates"] += 1
                self._counters["weight_update_s"] += time.perf_counter() - t0
        finally:
            self._updating = False
            self._refresh_gate()

    def sleep(self, level: int = 1) -> None:
        """Release device memory for a colocated trainer. In-flight requests are aborted; new
        requests wait for :meth:`wake_up`. What each level releases depends on the engine (see the
        plugin's docs); both keep the weights restorable, so outputs after ``wake_up`` are the
        same as before."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self._closed:
            raise RuntimeError(f"the {self.name} backend is shut down")
        self._loop.call(self._sleep(level))

    async def _sleep(self, level: int) -> None:
        if self._asleep:
            return
        self._asleep = level
        self._refresh_gate()
        try:
            await self._abort_inflight()
            await self._drain()
            await self._engine_sleep(level)
        except BaseException:
            self._asleep = 0
            self._refresh_gate()
            raise

    def wake_up(self) -> None:
        """Restore what :meth:`sleep` released and admit the requests that waited."""
        if self._closed:
            raise RuntimeError(f"the {self.name} backend is shut down")
        self._loop.call(self._wake())

    async def _wake(self) -> None:
        if not self._asleep:
            return
        await self._engine_wake_up()
        self._asleep = 0
        self._refresh_gate()

    def shutdown(self) -> None:
        """Abort everything, free the engine and stop the engine thread."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._loop.alive:
                self._loop.call(self._shutdown(), timeout=self.shutdown_timeout_s)
        except Exception:
            log.exception("%s backend: shutdown failed", self.name)
        finally:
            self._loop.stop()

    async def _shutdown(self) -> None:
        self._refresh_gate()  # waiting requests see _closed and return "error"
        await self._abort_inflight()
        with contextlib.suppress(asyncio.TimeoutError):
            await self._drain(timeout=30.0)
        await self._engine_shutdown()

    # -------------------------------------------------------------------------- stats
    @staticmethod
    def _zero_counters() -> dict[str, float]:
        return {
            "generated_tokens": 0.0,
            "requests": 0.0,
            "aborted": 0.0,
            "errors": 0.0,
            "busy_s": 0.0,
            "weight_updates": 0.0,
            "weight_update_s": 0.0,
        }

    def _count(self, finish: str, n_tokens: int) -> None:
        with self._stats_lock:
            self._counters["generated_tokens"] += n_tokens
            self._counters["requests"] += 1
            if finish == "abort":
                self._counters["aborted"] += 1
            elif finish == "error":
                self._counters["errors"] += 1

    def stats(self) -> dict[str, float]:
        """Counters since the last call (``generated_tokens``, ``requests``, ``aborted``,
        ``errors``, ``busy_s`` - time with at least one request in flight -, ``weight_updates``,
        ``weight_update_s``; reset on read) and the gauges ``running`` and ``waiting``."""
        now = time.perf_counter()
        with self._stats_lock:
            out, self._counters = self._counters, self._zero_counters()
            busy_since = self._busy_since
            if busy_since is not None:
                out["busy_s"] += now - busy_since
                self._busy_since = now
        out["running"] = float(len(self._inflight))
        out["waiting"] = float(self._waiting)
        try:
            out.update(self._engine_stats())
        except Exception:
            log.debug("engine stats failed", exc_info=True)
        return out
