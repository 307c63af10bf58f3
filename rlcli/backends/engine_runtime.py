"""The engine-independent half of an inference-engine plugin (rlcli-vllm, rlcli-sglang,
rlcli-lmdeploy, or a third party's): subclass :class:`EngineBackend` and fill in the engine hooks.

:class:`EngineBackend` implements the parts of the :mod:`rlcli.backends.base` contract that do not
depend on the engine, once for all engines:

* **One engine thread.** The engine lives on a daemon thread that runs its own asyncio event loop
  (:class:`EngineLoop`). ``generate`` hands each request to that loop and awaits the result from the
  caller's loop, so the caller's loop never blocks on the engine and the engine's own asyncio
  machinery (SGLang's tokenizer manager, LMDeploy's request manager) sees one loop for its whole
  life, whatever loops its callers use (the conformance kit starts a new loop per check). The
  synchronous control calls (``pause``, ``update_weights``, ``sleep``, ``wake_up``, ``shutdown``)
  run as coroutines on that loop and block the calling thread until they are done.
* **Pause.** ``pause()`` asks the engine to abort every in-flight request (engines return the
  tokens generated so far; :class:`Job` accumulates them as they stream in) and makes later
  requests return ``"abort"`` at once with no tokens until ``resume()``.
* **Gate.** While the backend is asleep or loading weights, new requests wait before reaching
  the engine; they are admitted (and stamped with the policy version) when the gate opens.
* **Weight updates drain.** ``update_weights`` closes the gate, waits until no request is in
  flight (requests aborted by ``pause()`` end at once; others run to completion on the old
  weights), loads the tensors, sets the version and reopens the gate. So every token of a
  response comes from the weights of one policy version - the version stamped when the request
  was admitted - whatever the engine, and engines never have to swap weights under a running
  batch. Callers that do not want to wait call ``pause()`` first (as rlcli's runners do).
* **Checks before the engine.** Prompt validation (empty, ids outside the vocabulary, too long)
  and update validation (unknown names, wrong shapes: ``ValueError`` before anything changes)
  happen here, against the model's Hugging Face config and a meta-device instance of it.

An engine plugin subclasses :class:`EngineBackend` and implements the ``_engine_*`` hooks, which
always run on the engine loop.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import importlib.metadata
import importlib.util
import itertools
import logging
import math
import numbers
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Coroutine, Iterable, Sequence

import torch

from rlcli.backends.base import BackendContext, GenerateOutput, GenerateRequest, InferenceBackend
from rlcli.types import SampleParams

log = logging.getLogger(__name__)

_M64 = 0xFFFFFFFFFFFFFFFF
_SEED_MASK = 0x7FFFFFFFFFFFFFFF  # engines take seeds as signed 64-bit integers


# ------------------------------------------------------------------------------------------
# Engine package status (for check_config and `rlcli plugins`)
# ------------------------------------------------------------------------------------------
def managed_kwarg_issues(extra: Any, managed: dict[str, str]) -> list[tuple[str, str]]:
    """``engine_kwargs`` keys that the plugin sets itself (the user may not override them)."""
    return [("engine_kwargs", f"{key!r} is set by the plugin ({managed[key]})") for key in extra if key in managed]


@dataclass(frozen=True)
class EnginePackage:
    """The engine a plugin drives: its distribution, import name, tested version and install line."""

    label: str  # "vLLM"
    distribution: str  # "vllm"
    module: str  # "vllm"
    tested: str  # "0.26.0": the version this plugin release was written and checked against
    minimum: str  # oldest version whose API the plugin supports
    plugin: str  # "rlcli-vllm"

    @property
    def install_line(self) -> str:
        return f'pip install "{self.plugin}[engine]"'

    def installed_version(self) -> str | None:
        """The installed engine version, or None when the package is missing (nothing is imported)."""
        if importlib.util.find_spec(self.module) is None:
            return None
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return "unknown"

    def problem(self) -> str | None:
        """Why this engine cannot be used here (with the exact install line), or None."""
        version = self.installed_version()
        hint = (
            f"install it with: {self.install_line}  (that is {self.distribution}=={self.tested}, on a CUDA machine "
            f"whose torch matches it)"
        )
        if version is None:
            return f"the {self.label} engine is not installed (the '{self.module}' package cannot be imported); {hint}"
        if version != "unknown" and _version_tuple(version) < _version_tuple(self.minimum):
            return (
                f"{self.distribution} {version} is older than {self.minimum}, the oldest {self.plugin} "
                f"supports; {hint}"
            )
        return None

    def describe(self) -> str:
        """One line for ``rlcli plugins``: which engine version is installed."""
        version = self.installed_version()
        if version is None:
            return f"{self.distribution} not installed: {self.install_line}"
        note = "" if version == self.tested else f", tested with {self.tested}"
        return f"{self.distribution} {version}{note}"


def _version_tuple(version: str) -> tuple:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release
    except InvalidVersion:
        return ()


# ------------------------------------------------------------------------------------------
# Model facts read from the Hugging Face directory (no weights loaded)
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelInfo:
    """What the backend needs to know about a Hugging Face model to check requests and updates."""

    model_type: str
    vocab_size: int
    max_position_embeddings: int | None
    shapes: dict[str, tuple[int, ...]]  # state_dict name -> shape (tied aliases included)
    aliases: dict[str, str] = field(default_factory=dict)  # tied alias -> canonical name

    @property
    def tied(self) -> bool:
        return bool(self.aliases)


def read_model_info(model_dir: str | Path) -> ModelInfo:
    """Names and shapes of a model's ``state_dict`` from a meta-device instance of its config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(model_dir))
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    aliases = {alias: names[0] for names in groups.values() for alias in names[1:]}
    max_pos = getattr(text, "max_position_embeddings", None)
    return ModelInfo(
        model_type=str(getattr(cfg, "model_type", "")),
        vocab_size=int(text.vocab_size),
        max_position_embeddings=int(max_pos) if max_pos else None,
        shapes=shapes,
        aliases=aliases,
    )


# ------------------------------------------------------------------------------------------
# Pure helpers (unit-tested without any engine)
# ------------------------------------------------------------------------------------------
def stop_ids_for(params: SampleParams, eos_token_ids: Iterable[int]) -> list[int]:
    """Token ids that end a response: the EOS ids (unless ``ignore_eos``) and ``stop_token_ids``,
    deduplicated in order."""
    out: list[int] = []
    for t in ([] if params.ignore_eos else list(eos_token_ids)) + list(params.stop_token_ids):
        if int(t) not in out:
            out.append(int(t))
    return out


def validate_request(request: GenerateRequest, vocab_size: int, max_model_len: int | None) -> str | None:
    """Why ``request`` cannot be served (the ``error`` message), or None."""
    prompt = request.prompt_ids
    if not isinstance(request.params, SampleParams):
        return f"params must be a SampleParams, got {type(request.params).__name__}"
    if len(prompt) == 0:
        return "empty prompt: at least one prompt token is required"
    if max_model_len is not None and len(prompt) >= max_model_len:
        return (
            f"prompt has {len(prompt)} tokens but max_model_len is {max_model_len}; "
            f"the prompt must leave room for at least one generated token"
        )
    bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size]
    if bad:
        return f"prompt token ids out of range [0, {vocab_size}): {bad[:8]}"
    return None


def response_budget(params: SampleParams, prompt_len: int, max_model_len: int | None) -> int:
    """Tokens the response may have: ``max_tokens``, cut to what the context leaves."""
    if max_model_len is None:
        return params.max_tokens
    return max(0, min(params.max_tokens, max_model_len - prompt_len))


def prepare_weight_update(
    named_tensors: Iterable[tuple[str, Any]], info: ModelInfo
) -> list[tuple[str, torch.Tensor]]:
    """Check Hugging Face-named tensors against the model and map tied aliases to one name.

    Raises ``ValueError`` naming every unknown name and every shape mismatch (before anything is
    loaded). A tied alias (``lm_head.weight`` of a model with tied embeddings) becomes its canonical
    name (``model.embed_tokens.weight``) unless the canonical tensor is in the same call, in which
    case the alias is dropped: engines load tied weights under the canonical name only.
    """
    items = list(named_tensors)
    not_tensors = [str(name) for name, t in items if not isinstance(t, torch.Tensor)]
    if not_tensors:
        raise ValueError(f"update_weights: not tensors: {', '.join(not_tensors)}")
    unknown = [name for name, _ in items if name not in info.shapes]
    if unknown:
        sample = ", ".join(sorted(info.shapes)[:3])
        raise ValueError(
            f"update_weights: {len(unknown)} unknown tensor name(s): {', '.join(unknown)} "
            f"(expected Hugging Face state_dict names such as {sample}, ...)"
        )
    bad = [
        f"{name} {tuple(t.shape)} (model has {info.shapes[name]})"
        for name, t in items
        if tuple(t.shape) != info.shapes[name]
    ]
    if bad:
        raise ValueError(f"update_weights: shape mismatch for {', '.join(bad)}")
    present = {name for name, _ in items}
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in items:
        canonical = info.aliases.get(name)
        if canonical is not None:
            if canonical in present:
                continue
            name = canonical
        out.append((name, tensor))
    return out


def normalize_finish(reason: str | None, error: str | None, aborted: bool) -> tuple[str, str | None]:
    """The contract's finish reason for an engine's one.

    "stop" / "length" pass through. "abort" stays "abort" only when the plugin asked for it
    (pause, sleep, shutdown, a cancelled caller); an abort the engine decided on its own (out of
    memory, rejected input) is an "error" with the engine's message.
    """
    if reason in ("stop", "length"):
        return reason, None
    if reason == "abort":
        if aborted:
            return "abort", None
        return "error", error or "the engine aborted the request"
    return "error", error or f"the engine ended the request with finish reason {reason!r}"


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class SeedSequence:
    """Seeds for requests that carry none: distinct per run seed and rank, reproducible."""

    def __init__(self, seed: int, rank: int = 0):
        self._base = _splitmix64(((int(seed) & 0xFFFFFFFFFFF) << 20) ^ (int(rank) & 0xFFFFF))
        self._n = 0

    def __call__(self, requested: int | None) -> int:
        if requested is not None:
            return int(requested) & _SEED_MASK
        self._n += 1
        return _splitmix64(self._base + self._n) & _SEED_MASK


# ------------------------------------------------------------------------------------------
# The engine thread
# ------------------------------------------------------------------------------------------
class EngineLoop:
    """A daemon thread running its own asyncio event loop."""

    def __init__(self, name: str):
        self.name = name
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = threading.Event()

    def start(self) -> None:
        self._thread.start()
        self._started.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        try:
            self.loop.run_forever()
        finally:
            try:
                pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
                for t in pending:
                    t.cancel()
                if pending:
                    self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            except Exception:  # never let teardown raise in a daemon thread
                log.debug("engine loop teardown", exc_info=True)
            finally:
                self.loop.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def in_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Schedule ``coro`` on the engine loop; the returned future is thread-safe."""
        if not self.alive:
            coro.close()
            raise RuntimeError(f"the {self.name} engine thread has stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Run ``coro`` on the engine loop and wait for its result (from any other thread)."""
        if self.in_thread():
            coro.close()
            raise RuntimeError("a blocking engine call was made from the engine thread itself (it would deadlock)")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"the {self.name} engine did not answer within {timeout} s") from None

    def stop(self, timeout: float = 60.0) -> None:
        if not self.alive:
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        if not self.in_thread():
            self._thread.join(timeout)


# ------------------------------------------------------------------------------------------
# The backend
# ------------------------------------------------------------------------------------------
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
        if len(token_ids) != len(logprobs):
            raise RuntimeError(f"the engine returned {len(logprobs)} logprobs for {len(token_ids)} tokens")
        for lp in logprobs:
            if not isinstance(lp, (int, float)) or math.isnan(lp):
                raise RuntimeError(f"the engine returned an invalid logprob {lp!r}")
        self.token_ids.extend(int(t) for t in token_ids)
        self.logprobs.extend(float(lp) for lp in logprobs)


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
        """``rlcli validate``: problems of a recipe whose rollout backend is this one."""
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
        """Engine-specific recipe problems (the rollout backend is this one)."""
        return []

    # -------------------------------------------------------------------------- hooks
    def _resolve_max_model_len(self) -> int | None:
        """Prompt + response tokens per sequence (before the engine starts; the engine may refine it)."""
        return getattr(self.config, "max_model_len", None) or self.model_info.max_position_embeddings

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
            fut = self._loop.submit(self._generate(request))
        except RuntimeError as exc:
            return GenerateOutput(finish_reason="error", error=str(exc))
        return await asyncio.wrap_future(fut)

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
        prompt = [int(t) for t in request.prompt_ids]
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
