"""``EmbeddedBackend``: the :mod:`rlcli.backends.base` contract over the embedded engine.

``generate`` enqueues a request; a driver task on the running event loop runs engine steps in one
dedicated worker thread while there is work. Weight updates, sleep/wake and shutdown are
serialised with the steps by one lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import ClassVar, Iterable, Literal

import torch
from pydantic import Field

from rlcli.backends.base import BackendContext, GenerateOutput, GenerateRequest, InferenceBackend
from rlcli.backends.decode_attention import triton_decode_attention_available
from rlcli.backends.embedded.engine import EmbeddedEngine
from rlcli.backends.embedded.model import LlamaFamilyModel
from rlcli.backends.seeds import splitmix64
from rlcli.backends.embedded.state import Sequence
from rlcli.component import ComponentConfig
from rlcli.lockstep import settled

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_STEPS_SLICE_S = 0.02  # the longest run of engine steps between two visits to the event loop


def _release_cuda_workspaces() -> None:
    """Return cached CUDA memory to the driver, including cuBLAS workspaces (re-created on the
    next matrix product), so a colocated trainer can use it."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        try:
            clear()
        except RuntimeError:  # private API: never let it break sleep()
            log.debug("could not clear cuBLAS workspaces", exc_info=True)
    torch.cuda.empty_cache()


def _set_result_if_pending(fut: asyncio.Future, out: GenerateOutput) -> None:
    if not fut.done():
        fut.set_result(out)


class EmbeddedBackend(InferenceBackend):
    """Built-in continuous-batching engine in pure PyTorch (llama, mistral, qwen2, qwen3 models).

    Implements the :mod:`rlcli.backends.base` contract on top of :class:`EmbeddedEngine`.
    ``generate`` enqueues a request and awaits its future; a driver task, started lazily on the
    running event loop, runs engine steps one after another in a dedicated worker thread while
    there is work, so the loop stays responsive. One lock serialises steps with
    ``update_weights``, ``sleep``, ``wake_up`` and ``shutdown``. Requests without a ``seed`` get
    one from a counter seeded by ``ctx.seed`` (and ``ctx.rank``).
    """

    name: ClassVar[str] = "embedded"

    class Config(ComponentConfig):
        max_batch_size: int = Field(
            256, gt=0, description="Sequences decoded together: the number of KV-cache rows preallocated. "
            "Requests beyond it queue; fewer rows than the training sequences in flight (a step's groups times "
            "prompt_repeat_k, over-sampled groups included) is warned at start-up."
        )
        max_model_len: int | None = Field(
            None,
            gt=1,
            description="Prompt + response tokens per sequence (KV-cache length). Default: "
            "min(model max_position_embeddings, 4096). Longer prompts fail with finish_reason "
            "'error'; responses are cut at this length with finish_reason 'length'.",
        )
        max_prefill_tokens: int = Field(
            16384,
            gt=0,
            description="Padded prompt tokens per prefill forward pass; a single longer prompt is prefilled alone.",
        )
        prefix_sharing: bool = Field(
            True,
            description="Prefill identical prompts admitted together (a group's prompt_repeat_k copies) "
            "once and copy their KV cache.",
        )
        cuda_graphs: bool = Field(
            True,
            description="On CUDA, pad decode steps to bucketed shapes (rows, key length) and replay a CUDA graph "
            "captured per shape, removing the kernel-launch overhead of small models. Ignored on CPU.",
        )
        kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
            "auto", description="KV-cache dtype; auto = the model dtype."
        )
        attention: Literal["auto", "sdpa", "triton"] = Field(
            "auto",
            description="Decode attention: 'triton' = rlcli's Triton kernel (each row reads its own keys once per "
            "query-head group; needs CUDA, the triton package and a KV cache in the model dtype), 'sdpa' = PyTorch "
            "scaled_dot_product_attention with a mask over the padded key length, 'auto' = triton where it can run, "
            "else sdpa.",
        )
        compile: bool | None = Field(
            None,
            description="torch.compile each decoder layer's decode step and the token sampling (fuses their small "
            "operations; the first step pays a compilation of some seconds; a failed compilation falls back to "
            "eager PyTorch with a warning). Default (null): on for CUDA, off on CPU. For a small model in a short "
            "run, off can reach an accuracy sooner: the compilation costs more than it saves (docs/benchmarks.md, "
            "learning race).",
        )

        lockstep: bool | None = Field(
            None,
            description="Hand out finished responses every 8 engine steps and take the next steps only once the "
            "rollout's event loop has handled them (text decoding, judging, the produce strategy's decisions): "
            "production then repeats exactly, so a resumed run ends identical to one never interrupted, at the cost "
            "of the GPU waiting while the loop works on what was handed out. Default (null): on in a colocated run "
            "(the built-in produce strategies "
            "ask for it: a multi-turn loop's continuation turns, dynamic sampling's replacement groups and async's "
            "over-sampling and weight-sync pause reach the engine at timing-dependent moments otherwise); false "
            "trades exact repetition for not waiting.",
        )

    def __init__(self, config: "EmbeddedBackend.Config | None", ctx: BackendContext):
        super().__init__(config, ctx)
        cfg = self.config
        self._device = torch.device(ctx.device)
        self._graphs_cache_address: int | None = None  # the KV cache's address when sleep(1) kept the graphs
        hf_model = self._load_model(ctx)
        self._model = LlamaFamilyModel(hf_model)
        max_len = cfg.max_model_len or min(self._model.max_position_embeddings, 4096)
        if max_len > self._model.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_len} exceeds the model's max_position_embeddings="
                f"{self._model.max_position_embeddings}"
            )
        kv_dtype = None if cfg.kv_cache_dtype == "auto" else _DTYPES[cfg.kv_cache_dtype]
        self._engine = EmbeddedEngine(
            self._model,
            max_batch_size=cfg.max_batch_size,
            max_model_len=max_len,
            max_prefill_tokens=cfg.max_prefill_tokens,
            eos_token_ids=ctx.eos_token_ids,
            prefix_sharing=cfg.prefix_sharing,
            kv_cache_dtype=kv_dtype,
            pad_token_id=ctx.pad_token_id,
            version=ctx.version,
            shape_stable_decode=cfg.cuda_graphs and self._device.type == "cuda",
        )
        workload = ctx.workload
        if workload is not None and workload.train_sequences > cfg.max_batch_size:
            log.warning("rollout.max_batch_size=%d is below the %d training sequences the recipe has in flight at "
                        "once (its groups of a step times prompt_repeat_k, over-sampled ones included): the rest "
                        "wait for a free slot; rollout.max_batch_size: %d decodes them together",
                        cfg.max_batch_size, workload.train_sequences, workload.train_sequences)
        kv_matches = kv_dtype is None or kv_dtype == self._model.dtype
        if cfg.attention == "triton" or (
            cfg.attention == "auto" and self._device.type == "cuda" and kv_matches
            and triton_decode_attention_available(self._device)
        ):
            if not kv_matches:
                raise ValueError(f"attention 'triton' needs kv_cache_dtype 'auto' or the model dtype "
                                 f"({self._model.dtype}), got {cfg.kv_cache_dtype!r}")
            self._model.use_triton_attention()
        if cfg.compile if cfg.compile is not None else self._device.type == "cuda":
            self._model.compile_decode()
            self._engine.compile_sampler()
        self._lock = threading.Lock()
        self._paused = False
        self._asleep = 0
        #: sleep(1) keeps the KV cache: on the CPU it is host memory either way, and allocating it again
        #: at each wake-up is a full zero-fill (5 % of a toy recipe's step)
        self.keeps_cache_asleep = self._device.type == "cpu"
        self._closed = False
        self._engine.lockstep = bool(cfg.lockstep)  # the runner may turn it on: use_lockstep()
        self._driver: asyncio.Task | None = None
        self._driver_loop: asyncio.AbstractEventLoop | None = None
        # One dedicated worker thread runs every step: torch's intra-op thread pool is per
        # calling thread, and hopping between the loop's default executor threads would start
        # competing pools (several times slower on a small CPU).
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlcli-embedded")
        self._seed_base = splitmix64((int(ctx.seed) << 20) ^ (int(ctx.rank) & 0xFFFFF))
        self._seed_counter = 0

    @staticmethod
    def _load_model(ctx: BackendContext) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM  # heavy import, only when a backend is built

        model = AutoModelForCausalLM.from_pretrained(str(ctx.model_dir), dtype=ctx.dtype, trust_remote_code=False)
        model.to(ctx.device)
        model.eval()
        model.requires_grad_(False)
        return model

    # -------------------------------------------------------------------------- properties
    @property
    def version(self) -> int:
        return self._engine.version

    @property
    def engine(self) -> EmbeddedEngine:
        """The synchronous scheduler (for inspection and benchmarks)."""
        return self._engine

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def paused(self) -> bool:
        return self._paused

    # -------------------------------------------------------------------------- generate
    def _next_seed(self) -> int:
        self._seed_counter += 1
        return splitmix64(self._seed_base + self._seed_counter)

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Generate a response; see :mod:`rlcli.backends.base` for the contract.

        Invalid requests (empty prompt, token ids outside the vocabulary, prompt not shorter
        than ``max_model_len``) return ``finish_reason="error"`` with the reason in ``error``.
        """
        if self._closed:
            return GenerateOutput(finish_reason="error", error="the embedded backend is shut down")
        problem = self._engine.validate(request)
        if problem is not None:
            return GenerateOutput(finish_reason="error", error=problem)
        if self._paused:
            return GenerateOutput(finish_reason="abort")
        loop = asyncio.get_running_loop()
        seq = self._engine.make_sequence(request, self._next_seed())
        seq.future = loop.create_future()
        self._engine.submit(seq)
        self._ensure_driver(loop)
        try:
            return await seq.future
        except asyncio.CancelledError:
            self._engine.cancel(seq)
            raise

    def _ensure_driver(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._driver is None or self._driver.done() or self._driver_loop is not loop:
            self._driver_loop = loop
            self._driver = loop.create_task(self._drive(), name="rlcli-embedded-engine")

    def _kick(self) -> None:
        """Restart the driver (e.g. after wake_up) if requests are queued."""
        loop = self._driver_loop
        if loop is None or loop.is_closed() or not self._engine.has_work():
            return
        try:
            loop.call_soon_threadsafe(self._ensure_driver, loop)
        except RuntimeError:  # loop closed meanwhile
            pass

    def use_lockstep(self, wanted: bool) -> None:
        """What the run's produce strategies ask for (``lockstep``), unless the config says."""
        if self.config.lockstep is None:
            self._engine.lockstep = bool(wanted)

    async def _drive(self) -> None:
        """Run engine steps in the worker thread while there is work (the event loop stays free;
        in ``lockstep``, each run of steps waits until the loop has settled)."""
        loop = asyncio.get_running_loop()

        def more() -> bool:
            return not self._closed and self._engine.has_work() and (not self._asleep or self._paused)

        while more():
            if self._engine.lockstep:
                await settled()
                if not more():  # the loop paused, slept or closed the backend meanwhile
                    break
            try:
                done = await loop.run_in_executor(self._executor, self._locked_steps)
            except Exception as exc:  # never let a failed step strand the callers
                log.exception("embedded engine step failed")
                with self._lock:
                    done = self._engine.fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
            self._deliver(done)

    def _locked_steps(self) -> list[tuple[Sequence, GenerateOutput]]:
        """Engine steps back to back (in the worker thread) until a sequence finishes, the work
        runs out, the backend is paused, asleep or closed, or ``_STEPS_SLICE_S`` has passed. Each
        round trip between the event loop and the worker thread costs a few hundred microseconds
        with the GPU idle, so one per decode step would add up; requests submitted meanwhile are
        admitted by the next step, and each step takes the lock on its own, so ``sleep`` or
        ``update_weights`` wait for at most one step plus the slice."""
        if self._engine.lockstep:
            return self._lockstep_slice()
        deadline = time.perf_counter() + _STEPS_SLICE_S
        while True:
            done = self._locked_step()
            if (done or self._closed or self._paused or self._asleep or not self._engine.has_work()
                    or time.perf_counter() >= deadline):
                return done

    def _lockstep_slice(self) -> list[tuple[Sequence, GenerateOutput]]:
        """Lockstep: engine steps until one at a lockstep boundary (every ``ENGINE_STEPS`` steps since
        the engine last ran out of work) has finishes to hand out (all of those since the last
        slice), or the work runs out, or the backend is paused, asleep or closed: boundaries that
        depend on step counts only, never on time."""
        done: list[tuple[Sequence, GenerateOutput]] = []
        while True:
            done += self._locked_step()
            if self._closed or self._paused or self._asleep or not self._engine.has_work():
                return done
            if done and self._engine.at_lockstep_boundary():
                return done

    def _locked_step(self) -> list[tuple[Sequence, GenerateOutput]]:
        with self._lock:
            if self._closed or self._paused:
                return self._engine.abort_all()
            if self._asleep:
                return []
            return self._engine.step()

    @staticmethod
    def _deliver(done: list[tuple[Sequence, GenerateOutput]]) -> None:
        """Resolve the futures of finished sequences, from any thread."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        for seq, out in done:
            fut = seq.future
            if fut is None or fut.done():
                continue
            loop = fut.get_loop()
            if loop is running:
                fut.set_result(out)
            else:
                try:
                    loop.call_soon_threadsafe(_set_result_if_pending, fut, out)
                except RuntimeError:  # its loop is closed: nobody is waiting any more
                    pass

    # -------------------------------------------------------------------------- control
    def pause(self) -> None:
        """Abort every in-flight request (finish "abort", tokens so far) and refuse new ones.

        If no step is running the requests are aborted at once, else at the end of that step.
        """
        self._paused = True
        if self._lock.acquire(blocking=False):
            try:
                done = self._engine.abort_all()
            finally:
                self._lock.release()
            self._deliver(done)

    def resume(self) -> None:
        """Accept requests again after :meth:`pause`."""
        self._paused = False

    accepts_live_weights: ClassVar[bool] = True  # update_weights copies (and casts) before it returns
    allows_expandable_segments: ClassVar[bool] = True  # the 7B long-tail benchmark ran so (docs/benchmarks.md)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy Hugging Face-named tensors into the model in place and set the policy version.

        Any subset of ``model.state_dict()`` names is accepted (``lm_head.weight`` of a tied
        model updates the shared embedding); tensors are cast to the engine's dtype and device.
        Unknown names or wrong shapes raise ``ValueError`` before anything is changed. Waits for
        a running step to end; tokens generated afterwards carry ``version``.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("the embedded backend is shut down")
            self._model.load_named_tensors(named_tensors)
            if self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
            self._engine.set_version(version)

    def sleep(self, level: int = 1) -> None:
        """Release device memory: the KV cache (level 1; kept on the CPU, where it is host memory
        anyway) and also the weights (level 2, moved to CPU memory). Requests still in flight are aborted; requests made while asleep wait for
        :meth:`wake_up`. On CPU the weights stay where they are. Level 1 leaves the freed memory
        in PyTorch's caching allocator, where a trainer in the same process reuses it at no cost,
        and keeps the captured decode graphs (their memory pool stays allocated);
        level 2 also drops the graphs and returns cached memory to the driver (for other processes)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        with self._lock:
            done = self._engine.abort_all()
            if level == 2:  # the weights move: every captured graph is stale
                self._engine.reset_cuda_graphs()
            else:  # kept while the cache comes back at the same address (see wake_up)
                self._graphs_cache_address = self._engine.cache.address
            if not self.keeps_cache_asleep or level == 2:
                self._engine.cache.free()
            if level == 2 and self._device.type == "cuda":
                self._model.to("cpu")
            if self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
                if level == 2:  # level 1 leaves freed memory in torch's cache, where a colocated trainer reuses it
                    _release_cuda_workspaces()
            self._asleep = max(self._asleep, level)
        self._deliver(done)

    def wake_up(self) -> None:
        """Restore what :meth:`sleep` released and resume serving queued requests."""
        with self._lock:
            if self._asleep >= 2 and self._device.type == "cuda":
                self._model.to(self._device)
            self._engine.cache.allocate()
            # The decode graphs hold the cache's address: they stay valid if the cache came back
            # there (PyTorch's allocator hands out the same block when what a colocated trainer
            # allocated meanwhile has been freed; not guaranteed, hence the check), which saves
            # re-capturing every graph in every rollout.
            if self._asleep and self._engine.cache.address != self._graphs_cache_address:
                self._engine.reset_cuda_graphs()
            self._graphs_cache_address = None
            self._asleep = 0
        self._kick()

    def shutdown(self) -> None:
        """Abort everything in flight and free the cache and the model."""
        with self._lock:
            if self._closed:
                return
            done = self._engine.abort_all()
            self._engine.reset_cuda_graphs()
            self._engine.cuda_graphs = None
            self._engine.cache.free()
            self._closed = True
            # drop every reference to the weights so their memory can be reclaimed
            self._engine.model = None
            self._model = None
            if self._device.type == "cuda":
                _release_cuda_workspaces()
        self._executor.shutdown(wait=False)
        self._deliver(done)

    def stats(self) -> dict[str, float]:
        """``generated_tokens``, ``prefill_tokens`` (computed, i.e. after prefix sharing),
        ``shared_prefill_tokens``, ``busy_s``, ``steps`` and, with CUDA graphs,
        ``cuda_graph_captures`` since the last call (reset on read), plus the gauges ``running``
        and ``waiting``."""
        return self._engine.pop_stats()
