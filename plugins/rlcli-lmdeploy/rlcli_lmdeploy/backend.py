"""``LMDeployBackend``: LMDeploy's PyTorch engine, in process, behind rlcli's inference-backend contract."""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
from types import SimpleNamespace
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field

from rlcli.backends.base import BackendContext
from rlcli.component import ComponentConfig
from rlcli.types import SampleParams
from rlcli.backends.engine_runtime import EngineBackend, Job, MemoryShare, memory_option
from rlcli_lmdeploy.logic import (
    BLOCK_SIZE,
    MANAGED_ENGINE_KWARGS,
    ENGINE,
    RESERVED_BLOCKS,
    engine_config_kwargs,
    finish_from_status,
    generation_kwargs,
    logprob_caveat,
    memory_kwargs,
    request_problem,
    token_logprobs,
    upcast_logits,
)

log = logging.getLogger(__name__)

# LMDeploy checks its environment (torch, triton, the model) in a spawned process at every engine
# start; once one engine of this process passed it, later ones skip it (seconds per start).
_ENV_CHECK_PASSED = False

_DOC = """
LMDeploy's PyTorch ``Engine`` runs in the rlcli process (the "uni" executor) with its asyncio loop
on the plugin's engine thread; requests go in as token ids through ``EngineInstance
.async_stream_infer`` (no tokenizer involved) from a pool of ``max_batch_size`` instances.

* **Logprobs**: ``logprobs_mode="raw_logprobs"``: ``log_softmax`` of the raw logits - the contract's
  value at temperature 1 and for greedy requests, temperature-1 logprobs otherwise (LMDeploy has no
  temperature-scaled mode; a warning is logged once). With ``float32_logits`` (default) the
  engine's logits are upcast before sampling, so the logprobs are float32 rather than bfloat16.
  A request whose ``return_logprob`` is false asks LMDeploy for none (``GenerationConfig
  .logprobs`` None).
* **Pause**: ``async_cancel(session_id)`` per in-flight request; LMDeploy answers ``CANCEL`` with
  the tokens generated so far, whose logprobs arrived with them.
* **Weights**: loaded in place into the engine's model (``model.load_weights`` with LMDeploy's own
  name mapping, then its post-load processing), since the "uni" executor has no
  ``update_params``. While asleep the weights are woken first (``wakeup(["weights"])``).
* **Sleep**: both levels call LMDeploy's ``sleep(1)``: the KV cache is freed and the weights move to
  CPU memory, so ``wake_up`` restores them exactly (LMDeploy's level 2 would drop them).
* **Context**: ``session_len`` is ``max_model_len`` or the model's ``max_position_embeddings``, cut
  to what the KV cache holds.
* **Start-up**: LMDeploy's environment check (a spawned process) runs for the first engine of the
  process only; a failed check raises instead of exiting the process.
* **Limits**: one GPU and one rank per run; prefix caching off (LMDeploy cannot invalidate cached
  prefixes when the weights change); temperature at most 2.
"""


class LMDeployBackend(EngineBackend):
    name: ClassVar[str] = "lmdeploy"
    engine = ENGINE
    managed_engine_kwargs = MANAGED_ENGINE_KWARGS
    float32_refusal = ("LMDeploy's PyTorch engine serves bfloat16 or float16 models, not float32 "
                       "(set model.dtype to bfloat16, or auto on a GPU)")

    class Config(ComponentConfig):
        cache_max_entry_count: MemoryShare = memory_option(
            "LMDeploy's num_gpu_blocks", "the share of the free GPU memory (after the weights) LMDeploy's KV cache "
            "takes (LMDeploy's cache_max_entry_count)")
        max_model_len: int | None = Field(
            None,
            gt=1,
            description="Prompt + response tokens per sequence (LMDeploy's session_len). Default: the model's. "
            "Longer prompts fail with finish_reason 'error'.",
        )
        max_batch_size: int | None = Field(
            None, gt=0, description="Sequences decoded together (LMDeploy's max_batch_size). Default: the recipe's "
            "sequences in flight (one step's groups x group size, or the largest eval set; at most 1024), "
            "else LMDeploy's."
        )
        cuda_graphs: bool = Field(
            True, description="Decode with CUDA graphs; false: LMDeploy's eager_mode (faster start-up, slower "
            "decoding).")
        float32_logits: bool = Field(
            True,
            description="Upcast the engine's logits to float32 before sampling, so that logprobs are float32 "
            "(LMDeploy computes them in the logits' dtype: bfloat16 logprobs, rounded by up to 0.03 per token, "
            "for a bfloat16 model).",
        )
        use_request_seeds: bool = Field(
            True, description="Pass each request's seed as LMDeploy's random_seed (reproducible samples per request)."
        )
        log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
            "WARNING",
            description="Level of LMDeploy's 'lmdeploy' logger (its pipeline's default; at INFO its engine "
            "logs every batch of requests it receives).",
        )
        engine_kwargs: dict[str, Any] = Field(
            default_factory=dict,
            description="More lmdeploy.PytorchEngineConfig fields, passed through as they are (e.g. block_size, "
            "max_prefill_token_num). Keys the plugin sets itself are refused.",
        )

    def __init__(self, config: "LMDeployBackend.Config | None", ctx: BackendContext):
        if ctx.world_size > 1:
            raise ValueError("rlcli-lmdeploy 0.1 supports single-rank runs only; use rollout.name=embedded or sglang")
        self._lmd: Any = None
        self._api: SimpleNamespace | None = None
        self._pool: asyncio.Queue | None = None
        self._sessions = itertools.count(1)
        self._asleep_tags: set[str] = set()
        super().__init__(config, ctx)

    def _resolve_max_model_len(self) -> int | None:
        return self.config.max_model_len or self.model_info.max_position_embeddings

    def _request_problem(self, params: SampleParams) -> str | None:
        return request_problem(params)

    def _logprob_caveat(self, params: SampleParams) -> str | None:
        return logprob_caveat(params)

    # -------------------------------------------------------------------------- engine
    @staticmethod
    def _load_api() -> SimpleNamespace:
        """The LMDeploy classes the plugin uses (imported only when an engine is built)."""
        from lmdeploy import GenerationConfig, PytorchEngineConfig
        from lmdeploy.pytorch import envs
        from lmdeploy.pytorch.engine import Engine

        return SimpleNamespace(
            Engine=Engine, GenerationConfig=GenerationConfig, PytorchEngineConfig=PytorchEngineConfig, envs=envs
        )

    def _build_engine(self, api: SimpleNamespace, engine_config: Any) -> Any:
        """``Engine.from_pretrained``, with LMDeploy's environment check only for the process's first
        engine, and its ``exit(1)`` on a failed check turned into an exception (a ``SystemExit`` on
        the engine thread would end the whole process)."""
        global _ENV_CHECK_PASSED
        envs = getattr(api, "envs", None)
        saved = getattr(envs, "enable_check_env", None)
        if _ENV_CHECK_PASSED and saved is not None:
            envs.enable_check_env = False
        try:
            engine = api.Engine.from_pretrained(str(self.ctx.model_dir), engine_config=engine_config)
        except SystemExit as exc:
            raise RuntimeError(f"LMDeploy's environment check failed (exit code {exc.code}); its log above "
                               f"says why") from None
        finally:
            if saved is not None:
                envs.enable_check_env = saved
        _ENV_CHECK_PASSED = True
        return engine

    # -------------------------------------------------------------------------- engine hooks
    async def _engine_start(self) -> None:
        self._api = api = self._load_api()
        # LMDeploy's logger starts at INFO (its pipeline lowers it; the Engine used here does not)
        logging.getLogger("lmdeploy").setLevel(self.config.log_level)
        device = torch.device(self.ctx.device)
        if device.type == "cuda":
            torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
        kv = None
        if self.config.cache_max_entry_count == "auto":
            block = int(self.config.engine_kwargs.get("block_size") or BLOCK_SIZE)
            kv = self.kv_budget(block_size=block, reserved_blocks=RESERVED_BLOCKS)
        kwargs = engine_config_kwargs(self.config, dtype=self.ctx.dtype, session_len=self.max_model_len,
                                      memory=memory_kwargs(self.config, kv), max_batch_size=self.max_batch_size)
        try:
            engine_config = api.PytorchEngineConfig(**kwargs)
        except Exception as exc:  # unknown or invalid engine_kwargs (TypeError, AssertionError, ...)
            raise ValueError(f"rollout.engine_kwargs: invalid LMDeploy PytorchEngineConfig {kwargs}: "
                             f"{type(exc).__name__}: {exc}") from exc
        self._lmd = self._build_engine(api, engine_config)
        if not hasattr(getattr(self._lmd, "executor", None), "model_agent"):
            self._lmd.close()
            raise RuntimeError("LMDeploy did not build the in-process ('uni') executor the plugin needs")
        if self.config.float32_logits:
            upcast_logits(self._lmd.executor.model_agent)
        self._lmd.start_loop()
        size = int(getattr(self._lmd.engine_config, "max_batch_size", None) or 256)
        self._pool = asyncio.Queue()
        for _ in range(size):
            self._pool.put_nowait(self._lmd.create_instance())
        # the KV cache may hold fewer tokens than session_len: LMDeploy's max_session_len is the smaller
        self.max_model_len = int(self._lmd.max_session_len)

    async def _engine_generate(self, job: Job) -> tuple[str, str | None]:
        gen_config = self._api.GenerationConfig(
            **generation_kwargs(job.params, stop_ids=job.stop_ids, budget=job.budget, seed=job.seed)
        )
        inst = await self._pool.get()
        try:
            if job.aborted:
                return "abort", None
            session_id = next(self._sessions)
            job.handle = (inst, session_id)
            stream = inst.async_stream_infer(session_id, list(job.prompt), gen_config=gen_config)
            recancelled = False
            # Each delta is parsed as it comes, and nothing of LMDeploy's output objects is kept:
            # this runs on LMDeploy's own event loop, between its engine steps (512 requests x 256
            # steps = 131k deltas). Keeping the deltas to parse them at the end was slower: objects
            # that outlive a few garbage collections make Python's full collections, which scan every
            # live object of the process, run again and again (measured over the fake engine, CPU).
            try:
                async for out in stream:
                    status = out.status.name
                    if out.token_ids:
                        self._take(job, out.token_ids, out.logprobs, status)
                    if status == "SUCCESS" and (recancelled or not job.aborted):
                        continue
                    finish, error = finish_from_status(status, job.token_ids, job.stop_ids)
                    if finish is not None:
                        return finish, error
                    if job.aborted and not recancelled:
                        # belt and braces: a cancel that found no running session
                        recancelled = True
                        await inst.async_cancel(session_id)
                return "error", "LMDeploy ended the stream without a final status"
            except asyncio.CancelledError:
                # a cancelled caller: the cancellation went through the stream, whose own cleanup
                # ended the session (END_SESSION also stops a running sequence)
                raise
            except BaseException:
                # a failure here between two outputs: stop the sequence, then let the stream end the
                # session (the order of LMDeploy's own AsyncEngine)
                try:
                    await asyncio.shield(inst.async_cancel(session_id))
                except BaseException:  # noqa: BLE001 - the original error is the one to report
                    log.debug("cancel of session %s failed", session_id, exc_info=True)
                raise
            finally:
                await stream.aclose()
        finally:
            job.handle = None
            self._pool.put_nowait(inst)

    @staticmethod
    def _take(job: Job, ids: Any, logprobs: Any, status: str) -> None:
        """Add one delta (token ids and their logprobs) to ``job``."""
        try:  # a request without return_logprob asked LMDeploy for none (generation_kwargs)
            job.add(ids, token_logprobs(ids, logprobs) if job.params.return_logprob else [])
        except ValueError:
            if status != "CANCEL":
                raise
            # a cancelled request's last tokens may come without their logprobs

    async def _engine_abort(self, jobs: list[Job]) -> None:
        handles = [j.handle for j in jobs if j.handle is not None]
        if handles:
            await asyncio.gather(*(inst.async_cancel(sid) for inst, sid in handles), return_exceptions=True)

    async def _engine_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        if "weights" in self._asleep_tags:
            self._lmd.wakeup(["weights"])
            self._asleep_tags.discard("weights")
        agent = self._lmd.executor.model_agent
        device = torch.device(self.ctx.device)
        if torch.cuda.is_available():
            # This thread's current CUDA stream is LMDeploy's forward stream (its model loop keeps it
            # entered), not the stream the trainer produced these tensors on: wait for them.
            torch.cuda.synchronize()
        tensors = [(name, t.detach().to(device=device, dtype=self.ctx.dtype)) for name, t in named_tensors]
        with agent.all_context():
            agent._load_updated_weight_bucket(tensors, "rlcli update_weights")
            agent._finalize_updated_weights()
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    async def _engine_sleep(self, level: int) -> None:
        # LMDeploy level 1 frees the KV cache and moves the weights to CPU memory; its level 2 would
        # drop the weights, which the contract must restore on wake_up: both levels map to 1.
        await self._lmd.sleep(1)
        self._asleep_tags = {"weights", "kv_cache"}

    async def _engine_wake_up(self) -> None:
        if self._asleep_tags:
            tags = None if self._asleep_tags == {"weights", "kv_cache"} else sorted(self._asleep_tags)
            self._lmd.wakeup(tags)
            self._asleep_tags = set()

    async def _engine_shutdown(self) -> None:
        engine, self._lmd = self._lmd, None
        if engine is None:
            return
        main = getattr(engine, "_loop_main", None)
        engine.close()
        if main is not None:
            await asyncio.wait([main], timeout=60)
        self._pool = None
        del engine
        gc.collect()  # LMDeploy raises the gc thresholds; its engine objects form reference cycles
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


LMDeployBackend.__doc__ = f"LMDeploy PyTorch engine, in process ({ENGINE.describe()}).\n" + _DOC
