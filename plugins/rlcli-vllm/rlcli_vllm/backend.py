"""``VLLMBackend``: vLLM's engine, in process, behind rlcli's inference-backend contract."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import logging
import os
import sys
import warnings
import weakref
from types import SimpleNamespace
from typing import Annotated, Any, ClassVar, Literal

import torch
from pydantic import Field

from rlcli.backends.base import BackendContext
from rlcli.component import ComponentConfig
from rlcli.types import SampleParams
from rlcli.backends.engine_runtime import EngineBackend, Job, memory_option
from rlcli_vllm.logic import (
    MANAGED_ENGINE_KWARGS,
    ENGINE,
    RESERVED_BLOCKS,
    engine_environment,
    engine_kwargs,
    finish_reason,
    kv_layout,
    memory_kwargs,
    logprob_caveat,
    request_problem,
    sampling_kwargs,
    token_logprobs,
)

log = logging.getLogger(__name__)

_DOC = """
vLLM's ``LLMEngine`` runs in the rlcli process (``multiprocess_mode=False``, the "uni" executor,
``skip_tokenizer_init``: token ids in, token ids out) and is stepped on the plugin's engine thread.
A request's output comes back once, when it finishes (``RequestOutputKind.FINAL_ONLY``, as
``LLM.generate`` asks for it: per-step outputs for 512 requests cost more host time per step than
the GPU's decode step on small models). ``pause()`` reads each in-flight request's tokens and
logprobs from vLLM's output-processor state, then aborts it (``abort_request``), so exactly the
tokens and logprobs produced so far come back.

* **Logprobs**: vLLM's ``logprobs_mode`` (option ``logprobs_mode``). The default,
  "processed_logprobs", is ``log_softmax(logits / T)`` - the contract's value - whenever top_k is 0
  and top_p is 1; with top-k/top-p vLLM renormalises over the kept set, and during the first
  ``min_tokens`` tokens the stop ids (and the model's EOS ids, even with ``ignore_eos``) leave the
  normaliser. "raw_logprobs" is the contract's value at temperature 1 (and greedy) whatever
  top-k/top-p/min_tokens. vLLM offers no mode that is exact for both; a warning is logged once when
  a request falls outside the chosen mode's range. Temperatures above 2 are refused (vLLM's range).
* **Weights**: ``update_weights`` checks names and shapes, then calls ``model.load_weights`` inside
  vLLM's worker (``worker_extension_cls``), which fuses q/k/v and gate/up and copies in place;
  the prefix cache is reset afterwards. While asleep, the weights are woken first
  (``wake_up(tags=["weights"])``) and the KV cache stays released.
* **Sleep**: both levels call vLLM's ``sleep(level=1)``: the KV cache is discarded and the weights
  are moved to CPU memory, so ``wake_up`` restores the exact weights (vLLM's level 2 would drop
  them). ``shutdown`` while asleep wakes the engine first (freeing unmapped sleep-mode memory is
  not safe in vLLM 0.26).
* **KV cache**: ``gpu_memory_utilization: auto`` (default) passes ``kv_cache_memory_bytes`` sized from
  the run's workload (:meth:`~rlcli.backends.engine_runtime.EngineBackend.kv_budget`); a number is
  vLLM's own share.
* **float32**: vLLM serves float32 models with its Triton attention backend (FlashAttention and
  FlashInfer are half-precision only); the plugin sets ``TRITON_F32_DEFAULT=ieee`` for float32
  engines (unless set) so that attention runs in full float32 instead of TF32.
* **Limits**: one GPU (``tensor_parallel_size`` 1) and one rank per run; the engine always runs on
  ``cuda:0`` of the process; one engine alive per process (vLLM's sleep-mode allocator is a
  process-wide singleton: shut one backend down before building the next). Models vLLM loads with
  ``load_weights`` in place (bf16/fp16/fp32 checkpoints; not quantized ones).
"""


def _cumem() -> Any:
    """vLLM's sleep-mode allocator (``CuMemAllocator``, a process-wide singleton), or None when there
    is none (no engine built yet, or no CUDA build of vLLM)."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except Exception:
        return None
    return CuMemAllocator.instance


def _cumem_bytes_in_use() -> int:
    """Bytes vLLM's sleep-mode allocator still holds."""
    allocator = _cumem()
    return 0 if allocator is None else int(allocator.get_current_usage())


# What an engine that was shut down may leave in vLLM's sleep-mode allocator before the next one
# refuses to start (see VLLMBackend._allocator_guard).
_STALE_LIMIT_BYTES = 64 * 2**20


def _cumem_leftovers() -> str:
    """What vLLM's sleep-mode allocator still holds, by tag (for messages)."""
    allocator = _cumem()
    by_tag: dict[str, list[int]] = {}
    for data in list(allocator.pointer_to_data.values()) if allocator is not None else []:
        by_tag.setdefault(str(data.tag), []).append(int(data.handle[1]))
    return ", ".join(f"{tag}: {len(sizes)} allocation(s), {sum(sizes) / 2**20:.0f} MiB" for tag, sizes in by_tag.items())


def _stale_holders(limit: int = 5) -> str:
    """Tensors still living in vLLM's sleep-mode allocations, with what refers to them (for the
    warning after shutdown: which object keeps the memory)."""
    allocator = _cumem()
    if allocator is None or not allocator.pointer_to_data:
        return ""
    ranges = [(int(p), int(p) + int(d.handle[1])) for p, d in list(allocator.pointer_to_data.items())]
    found = []
    with warnings.catch_warnings():  # isinstance() on some deprecated torch objects warns
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in tensors:
        try:
            if not obj.is_cuda:
                continue
            ptr = obj.untyped_storage().data_ptr()
        except Exception:
            continue
        if any(lo <= ptr < hi for lo, hi in ranges):
            owners = [type(r).__qualname__ for r in gc.get_referrers(obj) if r is not tensors][:4]
            found.append(f"{tuple(obj.shape)} {obj.dtype} held by {owners}")
            if len(found) >= limit:
                break
    return "; ".join(found) or "no live tensor found"


# Libraries that create module-level CUDA-capable tensors when first imported, with torch's default
# device. vLLM first imports them while it builds the model, inside its loader's
# ``torch.device("cuda")`` context and its sleep-mode "weights" pool, so the tensor lands in that
# pool and keeps a 2 MiB allocation referenced for the life of the process: flashinfer's FP4 table
# (16 float32 values; flashinfer-python 0.6.14, which vLLM 0.26.0 installs, imports it from its
# ``__init__``; vLLM imports flashinfer's attention backend module while choosing a backend, even
# when another backend is chosen). Found from the sources; matches the (16,) float32 tensor that the
# shutdown warning listed on the H200.
_PREIMPORT = ("flashinfer",)
_IMPORT_TIME_TABLES = (("flashinfer.quantization.fp4_quantization", "_E2M1_VALUES"),)


def _preimport_kernel_libraries() -> None:
    """Import :data:`_PREIMPORT` before vLLM builds its model, so their module-level tensors are
    created on the CPU, outside the sleep-mode pool (best effort: a library that is missing or fails
    to import is vLLM's business)."""
    for name in _PREIMPORT:
        try:
            importlib.import_module(name)
        except Exception:
            log.debug("vLLM backend: pre-import of %s failed", name, exc_info=True)


def _move_import_time_tables_to_cpu() -> None:
    """Move :data:`_IMPORT_TIME_TABLES` that ended up on the GPU (imported under vLLM's loader by an
    engine built before the pre-import, or by another vLLM user in the process) to the CPU, releasing
    their sleep-mode allocation. flashinfer only reads its FP4 table in a CPU fallback, after a
    ``.to(device)``."""
    for module, attr in _IMPORT_TIME_TABLES:
        mod = sys.modules.get(module)
        table = getattr(mod, attr, None) if mod is not None else None
        if table is not None and getattr(table, "is_cuda", False):
            setattr(mod, attr, table.cpu())


def _drop_engine_globals() -> None:
    """Release what vLLM keeps process-wide after an engine is gone, so that sleep-mode memory can
    return to the allocator: kernel libraries' import-time tables that landed on the GPU
    (:data:`_IMPORT_TIME_TABLES`), captured CUDA graphs (their wrappers are registered class-wide), the
    platform's global CUDA-graph pool, and the allocator's kept-alive memory pools. Each step is
    best effort (names as in vLLM 0.26.0)."""
    _move_import_time_tables_to_cpu()
    for module, cls in (("vllm.compilation.cuda_graph", "CUDAGraphWrapper"),
                        ("vllm.compilation.breakable_cudagraph", "BreakableCUDAGraphWrapper")):
        try:
            getattr(importlib.import_module(module), cls).clear_all_graphs()
        except Exception:
            log.debug("vLLM backend: %s.clear_all_graphs failed", cls, exc_info=True)
    try:
        from vllm.platforms import current_platform

        if getattr(type(current_platform), "_global_graph_pool", None) is not None:
            type(current_platform)._global_graph_pool = None
    except Exception:
        log.debug("vLLM backend: cannot drop the global CUDA-graph pool", exc_info=True)
    allocator = _cumem()
    if allocator is not None:
        try:
            allocator.release_pools()
        except Exception:
            log.debug("vLLM backend: CuMemAllocator.release_pools failed", exc_info=True)


def _collect_remainder() -> int:
    """Give freed sleep-mode memory back; when some is still held, also drop what vLLM keeps
    process-wide (``_drop_engine_globals``: this reaches every vLLM graph in the process, so only
    then) and collect again. Returns the bytes still held."""
    _release_device_memory()
    if _cumem_bytes_in_use():
        _drop_engine_globals()
        _release_device_memory()
    return _cumem_bytes_in_use()


def _release_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _keep_default_process_group(keep: bool):
    """While vLLM tears down its distributed state, keep a default process group it did not create.

    vLLM reuses an existing default ``torch.distributed`` group (rlcli's runners create one) and
    destroys it on shutdown (``cleanup_dist_env_and_memory``); the run still needs it afterwards.
    """
    if not keep or not torch.distributed.is_available():
        yield
        return
    import torch.distributed as dist

    original = dist.destroy_process_group

    def destroy(group=None):
        if group is None or group is dist.GroupMember.WORLD:
            return
        original(group)

    dist.destroy_process_group = destroy
    try:
        yield
    finally:
        dist.destroy_process_group = original


class VLLMBackend(EngineBackend):
    name: ClassVar[str] = "vllm"
    _live: ClassVar[weakref.WeakSet] = weakref.WeakSet()  # backends whose engine is up (one per process)
    engine = ENGINE
    managed_engine_kwargs = MANAGED_ENGINE_KWARGS

    class Config(ComponentConfig):
        gpu_memory_utilization: Annotated[float, Field(gt=0.0, le=1.0)] | Literal["auto"] = memory_option(
            "vLLM's kv_cache_memory_bytes", "the share of the GPU's memory vLLM may use for weights, activations and "
            "KV cache (vLLM's gpu_memory_utilization, which then sizes the cache)")
        max_model_len: int | None = Field(
            None,
            gt=1,
            description="Prompt + response tokens per sequence (vLLM's max_model_len). Default: the model's "
            "max_position_embeddings. Longer prompts fail with finish_reason 'error'.",
        )
        max_batch_size: int | None = Field(
            None, gt=0, description="Sequences decoded together (vLLM's max_num_seqs). Default: the recipe's "
            "sequences in flight (one step's groups x group size, or the largest eval set; at most 1024), "
            "else vLLM's."
        )
        tensor_parallel_size: int = Field(
            1, ge=1, description="GPUs per engine. This plugin version supports 1 (weights are loaded in process)."
        )
        cuda_graphs: bool = Field(
            True, description="Decode with CUDA graphs (and vLLM's torch.compile); false runs vLLM eagerly (its "
            "enforce_eager): faster start-up, slower decoding."
        )
        enable_prefix_caching: bool | None = Field(
            None,
            description="vLLM's automatic prefix caching (the prompt_repeat_k copies of a prompt share its KV "
            "cache). Default: vLLM's (on). Reset after every weight update.",
        )
        logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = Field(
            "processed_logprobs",
            description="Which logprobs vLLM returns: 'processed_logprobs' equals log_softmax(logits / T) when "
            "top_k is 0 and top_p is 1 (renormalised over the kept set otherwise); 'raw_logprobs' equals it at "
            "temperature 1 (and greedy) whatever top_k/top_p.",
        )
        use_request_seeds: bool = Field(
            True,
            description="Pass each request's seed to vLLM (reproducible samples per request). Cheap on vLLM's V2 "
            "model runner (dense models; about 14 % of decode throughput on the 0.5B benchmark, with logprobs); "
            "on V1 (MoE models) seeded rows are sampled one by one, which is slower. False: vLLM's own random stream.",
        )
        engine_kwargs: dict[str, Any] = Field(
            default_factory=dict,
            description="More vllm.EngineArgs, passed through as they are (e.g. kv_cache_dtype, "
            "async_scheduling, compilation_config). Keys the plugin sets itself are refused.",
        )

    @classmethod
    def extra_config_issues(cls, cfg: "VLLMBackend.Config") -> list[tuple[str, str]]:
        if cfg.tensor_parallel_size != 1:
            return [("tensor_parallel_size", "rlcli-vllm 0.1 runs vLLM in process on one GPU; tensor_parallel_size must be 1")]
        return []

    def __init__(self, config: "VLLMBackend.Config | None", ctx: BackendContext):
        if ctx.world_size > 1:
            raise ValueError(
                "rlcli-vllm 0.1 supports single-rank runs only (vLLM's in-process engine always uses cuda:0 "
                "of its process); use rollout.name=embedded or sglang for multi-rank runs"
            )
        device = torch.device(ctx.device)
        if device.type == "cuda" and device.index not in (None, 0):
            raise ValueError(f"vLLM's in-process engine runs on cuda:0, not {device}")
        self._engine: Any = None
        self._api: SimpleNamespace | None = None
        self._waiters: dict[str, tuple[asyncio.Future, Job]] = {}
        self._driver: asyncio.Task | None = None
        self._weights_asleep = False
        self._kv_asleep = False
        self._steps = 0
        self._owns_default_group = True
        super().__init__(config, ctx)

    # -------------------------------------------------------------------------- engine
    @staticmethod
    def _load_api() -> SimpleNamespace:
        """The vLLM classes the plugin uses (imported only when an engine is built)."""
        from vllm import SamplingParams
        from vllm.engine.arg_utils import EngineArgs
        from vllm.sampling_params import RequestOutputKind
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor import Executor

        return SimpleNamespace(
            SamplingParams=SamplingParams,
            RequestOutputKind=RequestOutputKind,
            EngineArgs=EngineArgs,
            UsageContext=UsageContext,
            LLMEngine=LLMEngine,
            Executor=Executor,
        )

    def _engine_kwargs(self) -> dict[str, Any]:
        """``EngineArgs`` of this run; with ``gpu_memory_utilization: auto`` the KV cache is sized from
        the workload (:meth:`kv_budget`)."""
        kv = None
        if self.config.gpu_memory_utilization == "auto":
            block, kv_bytes = kv_layout(self.config)
            kv = self.kv_budget(block_size=block, reserved_blocks=RESERVED_BLOCKS, dtype_bytes=kv_bytes)
        device = torch.device(self.ctx.device)
        total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
        memory = memory_kwargs(self.config, kv, weight_bytes=self.weight_bytes, device_bytes=total)
        return engine_kwargs(self.config, model_dir=self.ctx.model_dir, dtype=self.ctx.dtype, seed=self.ctx.seed,
                             memory=memory, max_batch_size=self.max_batch_size)

    def _build_engine(self, api: SimpleNamespace) -> tuple[Any, int]:
        """An in-process ``LLMEngine`` and its resolved ``max_model_len``."""
        kw = self._engine_kwargs()
        try:
            args = api.EngineArgs(**kw)
        except TypeError as exc:
            raise ValueError(f"rollout.engine_kwargs: {exc}") from exc
        vllm_config = args.create_engine_config(api.UsageContext.LLM_CLASS)
        engine = api.LLMEngine(
            vllm_config=vllm_config,
            executor_class=api.Executor.get_class(vllm_config),
            log_stats=False,
            usage_context=api.UsageContext.LLM_CLASS,
            multiprocess_mode=False,
        )
        return engine, int(vllm_config.model_config.max_model_len)

    # -------------------------------------------------------------------------- engine hooks
    async def _engine_start(self) -> None:
        self._api = self._load_api()
        self._owns_default_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        if self.requires_cuda:
            for key, value in engine_environment(self.ctx.dtype, os.environ).items():
                os.environ[key] = value
                log.info("vLLM backend: %s=%s", key, value)
        _preimport_kernel_libraries()
        try:
            with self._allocator_guard():
                self._engine, self.max_model_len = self._build_engine(self._api)
        except BaseException:
            self._cleanup_failed_start()
            raise
        VLLMBackend._live.add(self)

    @contextlib.contextmanager
    def _allocator_guard(self):
        """vLLM asserts that its sleep-mode allocator is empty when an engine loads its weights (one
        engine per process). Collect what an earlier engine left; refuse to start next to a live vLLM
        backend or over a large remainder. A small remainder of an engine that was shut down (with
        vLLM 0.26 every engine left one 2 MiB "weights" allocation referenced after ``shutdown``,
        measured on the H200: flashinfer's FP4 table, which :func:`_preimport_kernel_libraries` now
        keeps out of the pool) is left out of that assertion while this engine loads: it stays in the
        allocator's books and sleeps and wakes with this engine. Its holder is some object kept
        alive process-wide, so it is not expected to be freed while this engine sleeps; if it were,
        vLLM 0.26 would unmap the sleeping memory a second time (the hazard ``_engine_shutdown``
        avoids by waking first).
        Each engine adds its remainder: about 32 engines per process fit under the limit."""
        if _cumem_bytes_in_use() == 0:
            yield
            return
        if any(b is not self for b in list(VLLMBackend._live)):
            raise RuntimeError("another vLLM backend is running in this process; vLLM runs one sleep-mode engine per "
                               "process: shut the other vllm backend down first")
        held = _collect_remainder()
        if held == 0:
            yield
            return
        if held > _STALE_LIMIT_BYTES:
            raise RuntimeError(
                f"vLLM's sleep-mode allocator still holds {held / 2**20:.0f} MiB of an earlier vLLM engine in this "
                f"process ({_cumem_leftovers()}); vLLM runs one sleep-mode engine per process: drop the references "
                f"to the earlier engine, or start this one in a new process"
            )
        allocator = _cumem()
        stale = set(allocator.pointer_to_data)
        log.warning("vLLM backend: %s of an earlier, shut-down vLLM engine is still referenced (%s); starting the "
                    "new engine beside it", f"{held / 2**20:.0f} MiB", _cumem_leftovers())

        def usage_without_stale() -> int:
            return sum(int(d.handle[1]) for p, d in list(allocator.pointer_to_data.items()) if p not in stale)

        allocator.get_current_usage = usage_without_stale  # instance attribute: shadows the method
        try:
            yield
        finally:
            del allocator.get_current_usage

    def _cleanup_failed_start(self) -> None:
        """A start that failed half way: release vLLM's distributed state and memory for the next try."""
        try:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            with _keep_default_process_group(not self._owns_default_group):
                cleanup_dist_env_and_memory()
        except Exception:
            log.debug("cleanup after a failed vLLM start", exc_info=True)
        _release_device_memory()

    async def _engine_generate(self, job: Job) -> tuple[str, str | None]:
        sp = self._api.SamplingParams(
            **sampling_kwargs(job.params, stop_ids=job.stop_ids, budget=job.budget, seed=job.seed),
            output_kind=self._api.RequestOutputKind.FINAL_ONLY,
        )
        fut = asyncio.get_running_loop().create_future()
        self._waiters[job.rid] = (fut, job)
        try:
            self._engine.add_request(job.rid, {"prompt_token_ids": job.prompt}, sp)
        except Exception:
            self._waiters.pop(job.rid, None)
            raise
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive(), name="rlcli-vllm-steps")
        return await fut

    async def _drive(self) -> None:
        """Step the engine while requests wait; other engine-loop work runs between steps."""
        try:
            while self._waiters:
                if not self._engine.has_unfinished_requests():
                    raise RuntimeError("vLLM has no unfinished request but rlcli still waits for some")
                for out in self._engine.step():
                    self._on_output(out)
                self._steps += 1
                await asyncio.sleep(0)
        except Exception as exc:
            log.exception("vLLM engine step failed")
            waiters, self._waiters = self._waiters, {}
            with contextlib.suppress(Exception):
                self._engine.abort_request(list(waiters))
            for fut, _ in waiters.values():
                if not fut.done():
                    fut.set_exception(RuntimeError(f"vLLM engine step failed: {type(exc).__name__}: {exc}"))

    def _on_output(self, out: Any) -> None:
        entry = self._waiters.get(out.request_id)
        if entry is None:
            return
        fut, job = entry
        comp = out.outputs[0] if out.outputs else None
        try:
            if comp is not None and len(comp.token_ids):
                ids = list(comp.token_ids)
                job.add(ids, token_logprobs(ids, comp.logprobs) if job.params.return_logprob else [])
        except Exception as exc:
            self._waiters.pop(out.request_id, None)
            with contextlib.suppress(Exception):
                self._engine.abort_request([out.request_id])
            if not fut.done():
                fut.set_exception(exc)
            return
        if out.finished:
            self._waiters.pop(out.request_id, None)
            reason = finish_reason(comp.finish_reason if comp is not None else None) or "error"
            if not fut.done():
                fut.set_result((reason, None))

    async def _engine_abort(self, jobs: list[Job]) -> None:
        rids = [j.rid for j in jobs if j.rid in self._waiters]
        if not rids:
            return
        failed: dict[str, Exception] = {}
        for rid in rids:  # before abort_request drops the state; one bad read must not stop the others
            try:
                job = self._waiters[rid][1]
                job.add(*self._partial_output(rid, job.params.return_logprob))
            except Exception as exc:
                failed[rid] = exc
        self._engine.abort_request(rids)
        for rid in rids:
            fut, _ = self._waiters.pop(rid)
            if fut.done():
                continue
            if rid in failed:
                fut.set_exception(RuntimeError(f"vLLM: cannot read the partial output of {rid}: {failed[rid]}"))
            else:
                fut.set_result(("abort", None))

    def _partial_output(self, rid: str, with_logprobs: bool = True) -> tuple[list[int], list[float]]:
        """Tokens and logprobs (none unless ``with_logprobs``) a request has produced so far, from
        vLLM's output processor (``LLMEngine.output_processor``: external request id -> internal ids
        -> ``RequestState``, whose detokenizer holds the output token ids and whose logprobs
        processor the logprobs; with ``FINAL_ONLY`` nothing of them was sent yet)."""
        proc = self._engine.output_processor
        for internal in list(proc.external_req_ids.get(rid, ())):
            state = proc.request_states.get(internal)
            if state is None:
                continue
            ids = list(state.detokenizer.output_token_ids)  # a copy: vLLM appends to its own list
            return ids, token_logprobs(ids, state.logprobs_processor.logprobs) if with_logprobs else []
        return [], []

    async def _engine_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        if self._weights_asleep:
            self._engine.wake_up(tags=["weights"])
            self._weights_asleep = False
        self._engine.collective_rpc("rlcli_load_weights", args=(named_tensors,))
        if not self._engine.reset_prefix_cache():
            log.warning("vLLM could not reset its prefix cache after a weight update")

    async def _engine_sleep(self, level: int) -> None:
        # vLLM level 1 discards the KV cache and moves the weights to CPU memory; its level 2 would
        # drop the weights, which the contract must restore on wake_up: both levels map to 1.
        self._engine.sleep(level=1)
        self._weights_asleep = self._kv_asleep = True

    async def _engine_wake_up(self) -> None:
        if self._weights_asleep and self._kv_asleep:
            self._engine.wake_up()
        elif self._kv_asleep:
            self._engine.wake_up(tags=["kv_cache"])
        elif self._weights_asleep:
            self._engine.wake_up(tags=["weights"])
        self._weights_asleep = self._kv_asleep = False

    async def _engine_shutdown(self) -> None:
        waiters, self._waiters = self._waiters, {}
        for fut, _ in waiters.values():
            if not fut.done():
                fut.set_result(("abort", None))
        if self._engine is None:
            return
        if self._weights_asleep or self._kv_asleep:
            # Tensors freed while their sleep-mode memory is unmapped make vLLM 0.26's allocator
            # unmap/release it a second time (CUDA errors, stale error codes for the next engine).
            try:
                await self._engine_wake_up()
            except Exception:
                log.warning("vLLM backend: wake_up before shutdown failed", exc_info=True)
        engine, self._engine = self._engine, None
        VLLMBackend._live.discard(self)
        try:
            with _keep_default_process_group(not self._owns_default_group):
                engine.engine_core.shutdown()
        finally:
            # The LLMEngine holds the model until it is collected (its finalizer): drop it, then
            # give the sleep-mode pool back so that a later engine in this process can start.
            del engine
            held = _collect_remainder()
            if held:
                log.warning("vLLM backend: %.0f MiB of vLLM's sleep-mode memory is still referenced after shutdown "
                            "(%s; tensors in it: %s)", held / 2**20, _cumem_leftovers(), _stale_holders())

    def _engine_stats(self) -> dict[str, float]:
        steps, self._steps = self._steps, 0
        return {"steps": float(steps)}

    def _request_problem(self, params: SampleParams) -> str | None:
        return request_problem(params, [*params.stop_token_ids, *self.ctx.eos_token_ids])

    def _logprob_caveat(self, params: SampleParams) -> str | None:
        return logprob_caveat(self.config.logprobs_mode, params)


VLLMBackend.__doc__ = f"vLLM engine, in process ({ENGINE.describe()}).\n" + _DOC
