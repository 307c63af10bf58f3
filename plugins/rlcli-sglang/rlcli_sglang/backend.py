"""``SGLangBackend``: SGLang's offline ``Engine`` behind rlcli's inference-backend contract."""

from __future__ import annotations

import asyncio
import atexit
import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
from pydantic import Field

from rlcli.backends.base import BackendContext
from rlcli.component import ComponentConfig
from rlcli.backends.engine_runtime import EngineBackend, Job, MemoryShare, memory_option
from rlcli_sglang.logic import (
    FLOAT32_REFUSAL,
    MANAGED_ENGINE_KWARGS,
    ENGINE,
    PAGE_SIZE,
    batch_outputs,
    engine_kwargs,
    finish_reason,
    first_stop,
    memory_kwargs,
    parse_output,
    plan_phases,
    settle_finish,
    usable_context,
)

log = logging.getLogger(__name__)

_DOC = """
SGLang's offline ``Engine`` (no HTTP server): its tokenizer manager lives on the plugin's engine
thread, the scheduler and detokenizer in the subprocesses SGLang starts. Requests go in as token
ids (``skip_tokenizer_init``) straight to the tokenizer manager's ``generate_request``.

* **Logprobs**: SGLang returns ``log(softmax(logits / T))`` over the whole vocabulary, before
  top-k/top-p filtering - the contract's value for every sampling setting. A request whose
  ``return_logprob`` is false asks SGLang for none (its tokens are read from ``output_ids``),
  except a streamed one, whose tokens the plugin reads from the logprob entries.
* **Pause**: ``abort_request(rid)`` per in-flight request; SGLang answers with the tokens and
  logprobs generated so far (finish "abort").
* **Weights**: ``update_weights_from_tensor`` (tensors shared with the scheduler through CUDA IPC;
  SGLang maps Hugging Face names, fuses q/k/v and gate/up, and flushes the radix cache). While
  asleep, the weights are resumed first.
* **Idle first**: SGLang's scheduler refuses (and dies on) a memory release while it still holds a
  finished batch, so sleep and weight updates first wait for a deferred ``flush_cache`` to answer.
* **Sleep** (``enable_memory_saver``): level 1 releases the KV cache; level 2 releases the KV cache,
  the weights (backed up in CPU memory: ``enable_weights_cpu_backup``) and the CUDA-graph memory.
* **min_tokens** is served as two SGLang requests (stop ids at ``-inf`` logit bias for the first
  ``min_tokens`` tokens, then the rest), because SGLang refuses ``min_new_tokens`` without a
  tokenizer. ``ignore_eos`` together with ``stop_token_ids`` streams the request and the plugin
  stops it at the first stop id (SGLang's ``ignore_eos`` switches every stop id off).
* **Seeds**: off by default (``use_request_seeds``): SGLang reads a request's ``sampling_seed`` only
  with ``enable_deterministic_inference`` (batch-invariant kernels, pytorch sampler: slower), which
  the option turns on.
* **Batches** (``batch_requests``, off by default): the non-streamed SGLang requests that a
  caller's event loop makes in one turn (an agent loop's ``asyncio.gather``), or that the engine
  loop makes in one turn (second ``min_tokens`` phases), go to SGLang as one batched
  ``generate_request``, as ``Engine.generate`` on a list does. Each keeps its rid (pause aborts
  each). SGLang answers a batch only when every request in it is done. A request it refuses fails
  the whole batch, whose requests are then sent one by one.
* **Length**: SGLang serves at most ``context_length - 2`` tokens per sequence, so ``max_model_len``
  (prompt + response) is that.
* **float32** is refused when the backend is built (sgl-kernel's fused RMSNorm has no float32 path).
"""


class SGLangBackend(EngineBackend):
    name: ClassVar[str] = "sglang"
    engine = ENGINE
    managed_engine_kwargs = MANAGED_ENGINE_KWARGS
    float32_refusal = FLOAT32_REFUSAL  # a clear error up front, not a dead scheduler and a SIGQUIT later
    idle_timeout_s: ClassVar[float] = 120.0
    batch_hold_s: ClassVar[float] = 0.5  # batch_requests: the longest a queued request waits for more

    class Config(ComponentConfig):
        mem_fraction_static: MemoryShare = memory_option(
            "SGLang's max_total_tokens", "the share of the GPU's memory SGLang reserves for weights and KV cache "
            "(SGLang's mem_fraction_static, which then sizes the pool)")
        max_model_len: int | None = Field(
            None,
            gt=1,
            description="SGLang's context_length (default: the model's). SGLang serves at most this minus 2 "
            "prompt + response tokens per sequence; longer prompts fail with finish_reason 'error'.",
        )
        max_batch_size: int | None = Field(
            None, gt=0, description="Requests decoded together (SGLang's max_running_requests). Default: the recipe's "
            "sequences in flight (one step's groups x group size, or the largest eval set; at most 1024), "
            "else SGLang's. Decode CUDA graphs are captured up to it (at most 1024 rows; SGLang's own "
            "default stops at 256 on a 141 GB GPU) unless engine_kwargs names graph sizes."
        )
        tensor_parallel_size: int = Field(
            1, ge=1, description="GPUs per engine (SGLang's tp_size), from the run's device on.")
        cuda_graphs: bool = Field(
            True, description="Decode with CUDA graphs; false: SGLang's disable_cuda_graph (faster start-up, slower "
            "decoding).")
        use_request_seeds: bool = Field(
            False,
            description="Pass each request's seed as SGLang's sampling_seed and start SGLang with "
            "enable_deterministic_inference, the only mode in which it reads per-request seeds "
            "(batch-invariant kernels and the pytorch sampler: slower).",
        )
        batch_requests: bool = Field(
            False,
            description="Send the non-streamed requests that the caller makes in one event-loop turn (an "
            "asyncio.gather of generate calls, as the agent loop sends a rollout) to SGLang as one batched "
            "request, as SGLang's offline Engine.generate on a list does, so its scheduler receives them "
            "together. SGLang answers a batch only when all its requests are done: a request that finishes "
            "early waits for the batch's slowest. For single-turn synchronous rollouts, not for multi-turn "
            "agent loops or streaming/partial rollout pipelines.",
        )
        log_level: str = Field("error", description="SGLang's log level.")
        engine_kwargs: dict[str, Any] = Field(
            default_factory=dict,
            description="More SGLang ServerArgs, passed through as they are (e.g. attention_backend, "
            "disable_radix_cache, sampling_backend). Keys the plugin sets itself are refused.",
        )

    def __init__(self, config: "SGLangBackend.Config | None", ctx: BackendContext):
        self._sgl: Any = None
        self._api: SimpleNamespace | None = None
        self._tm: Any = None
        self._released: set[str] = set()
        self._queued: list[_Queued] = []  # batch_requests: requests for the next batch (engine loop)
        self._queued_since = 0.0
        self._flush_turn = 0  # the flush scheduled last
        self._batches: set[asyncio.Task] = set()
        super().__init__(config, ctx)
        self.batch_requests: bool = self.config.batch_requests  # the runtime switch behind the option

    # -------------------------------------------------------------------------- engine
    @staticmethod
    def _load_api() -> SimpleNamespace:
        """The SGLang classes the plugin uses (imported only when an engine is built)."""
        from sglang.srt.entrypoints.engine import Engine
        from sglang.srt.managers.io_struct import (
            GenerateReqInput,
            ReleaseMemoryOccupationReqInput,
            ResumeMemoryOccupationReqInput,
            UpdateWeightsFromTensorReqInput,
        )
        from sglang.srt.utils import MultiprocessingSerializer

        return SimpleNamespace(
            Engine=Engine,
            GenerateReqInput=GenerateReqInput,
            ReleaseMemoryOccupationReqInput=ReleaseMemoryOccupationReqInput,
            ResumeMemoryOccupationReqInput=ResumeMemoryOccupationReqInput,
            UpdateWeightsFromTensorReqInput=UpdateWeightsFromTensorReqInput,
            serialize=MultiprocessingSerializer.serialize,
        )

    # -------------------------------------------------------------------------- engine hooks
    async def _engine_start(self) -> None:
        self._api = api = self._load_api()
        device = torch.device(self.ctx.device)
        if device.index is not None:
            gpu_id = device.index
        else:
            gpu_id = torch.cuda.current_device() if device.type == "cuda" else 0
        kv = None
        if self.config.mem_fraction_static == "auto":
            page = int(self.config.engine_kwargs.get("page_size") or PAGE_SIZE)
            kv = self.kv_budget(block_size=page)
        kw = engine_kwargs(
            self.config, model_dir=self.ctx.model_dir, dtype=self.ctx.dtype, seed=self.ctx.seed, gpu_id=gpu_id,
            memory=memory_kwargs(self.config, kv), max_batch_size=self.max_batch_size,
        )
        try:
            # Built on the engine thread inside a coroutine: the tokenizer manager binds to this loop.
            self._sgl = api.Engine(**kw)
        except TypeError as exc:
            raise ValueError(f"rollout.engine_kwargs: {exc}") from exc
        self._tm = self._sgl.tokenizer_manager
        self.max_model_len = usable_context(self._tm.context_len, getattr(self._tm, "max_req_input_len", None))
        self._warn_on_model_eos()

    def _warn_on_model_eos(self) -> None:
        """SGLang also stops on the model config's EOS ids (unless ignore_eos); say so if the run's differ."""
        model_config = getattr(self._tm, "model_config", None)
        extra = sorted(set(getattr(model_config, "hf_eos_token_id", None) or ()) - set(self.ctx.eos_token_ids))
        if extra:
            log.warning(
                "SGLang also ends responses at the model config's EOS id(s) %s, which are not among the run's "
                "EOS ids %s", extra, list(self.ctx.eos_token_ids),
            )

    async def _engine_generate(self, job: Job) -> tuple[str, str | None]:
        reason, error = await self._run_phases(job)
        return settle_finish(reason, error, job.token_ids, job.stop_ids, job.budget)

    async def _run_phases(self, job: Job) -> tuple[str, str | None]:
        prompt = list(job.prompt)
        reason, error = "length", None
        for k, phase in enumerate(plan_phases(job.params, stop_ids=job.stop_ids, budget=job.budget, seed=job.seed)):
            if job.aborted:
                return "abort", None
            before = len(job.token_ids)
            reason, error = await self._run_phase(job, prompt + job.token_ids, phase, f"{job.rid}.{k}")
            if reason != "length" or len(job.token_ids) - before < phase.max_new:
                return reason, error
        return reason, error

    async def _run_phase(self, job: Job, prompt: list[int], phase, rid: str) -> tuple[str, str | None]:
        job.handle = rid
        if self.batch_requests and not phase.stream:
            answer = await self._in_batch(job, prompt, phase.sampling, rid)
            if not isinstance(answer, str):
                try:
                    return _finished(job, answer)
                except Exception as exc:
                    return _failed(job, exc)
            if job.aborted:
                return "abort", None
            rid = job.handle = answer  # not served in a batch: sent alone, under this rid
        # a streamed request's tokens are read from its logprob entries (see parse_output)
        obj = self._api.GenerateReqInput(
            input_ids=prompt, sampling_params=dict(phase.sampling), stream=phase.stream, rid=rid,
            return_logprob=job.params.return_logprob or phase.stream,
        )
        start = len(job.token_ids)
        gen = self._tm.generate_request(obj, None)
        try:
            if not phase.stream:
                return _finished(job, await gen.__anext__())
            stopped = False
            async for out in gen:
                ids, lps, ftype, message = parse_output(out)  # cumulative: the new part is past what we have
                if not stopped:
                    have = len(job.token_ids) - start
                    new_ids, new_lps = ids[have:], lps[have:]
                    cut = first_stop(new_ids, phase.plugin_stops)
                    if cut is not None:
                        job.add(new_ids[: cut + 1], new_lps[: cut + 1])
                        stopped = True
                        self._tm.abort_request(rid)  # drain until SGLang confirms the end
                    else:
                        job.add(new_ids, new_lps)
                if ftype is not None:
                    return ("stop", None) if stopped else finish_reason(ftype, message)
            return ("stop", None) if stopped else ("error", "SGLang ended the stream without a finish reason")
        except Exception as exc:
            return _failed(job, exc)
        finally:
            await gen.aclose()

    # -------------------------------------------------------------------------- batched requests
    def _in_batch(self, job: Job, prompt: list[int], sampling: dict[str, Any], rid: str) -> asyncio.Future:
        """Queue a non-streamed request for the next batch. The future's result is SGLang's output
        dict, or the rid under which to send the request alone (the batch did not serve it)."""
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        if not self._queued:
            self._queued_since = loop.time()
        self._queued.append(_Queued(job, prompt, dict(sampling), rid, answer))
        self._schedule_flush()
        return answer

    def _schedule_flush(self) -> None:
        """Flush after the callbacks already scheduled (the steps of requests on their way in);
        a flush scheduled earlier gives way to this one."""
        self._flush_turn += 1
        asyncio.get_running_loop().call_soon(self._flush, self._flush_turn)

    def _flush(self, turn: int) -> None:
        """Send what is queued as one batch, unless a later flush is scheduled (requests still
        arriving) - for at most ``batch_hold_s``. The requests a caller's loop makes in one turn
        reach this loop together (the runtime's relay), and queue here in the same turn."""
        overdue = asyncio.get_running_loop().time() - self._queued_since >= self.batch_hold_s
        if not self._queued or (not overdue and turn != self._flush_turn):
            return
        batch, self._queued = self._queued, []
        task = asyncio.ensure_future(self._send_batch(batch))
        self._batches.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self._batches.discard)

    async def _send_batch(self, batch: list[_Queued]) -> None:
        """One batched ``generate_request`` for the requests of ``batch`` not aborted meanwhile. If
        it raises, each request is sent alone instead, under a new rid (SGLang may still be ending
        the batch's requests, and routes outputs by rid)."""
        live = _unsent(batch)
        if len(live) < 2:
            for q in live:
                _answer(q, q.rid)
            return
        rids = [q.rid for q in live]
        obj = self._api.GenerateReqInput(
            input_ids=[q.prompt for q in live], sampling_params=[q.sampling for q in live],
            return_logprob=[q.job.params.return_logprob for q in live], stream=False, rid=rids,
        )
        # No await between the check above and SGLang registering the rids: a later abort reaches SGLang.
        gen = self._tm.generate_request(obj, None)
        try:
            answers: list[Any] = batch_outputs(await gen.__anext__(), rids)
        except asyncio.CancelledError:
            for q in live:
                q.answer.cancel()
            raise
        except Exception as exc:  # SGLang refused a request of the batch, or one was aborted before it was sent
            if not all(q.job.aborted for q in live):
                log.warning("SGLang batch of %d requests failed (%s: %s); sending them one by one",
                            len(live), type(exc).__name__, exc)
            answers = [f"{rid}.alone" for rid in rids]
        finally:
            await gen.aclose()  # leaves SGLang's model-update lock
        for q, answer in zip(live, answers):
            _answer(q, answer)

    async def _engine_abort(self, jobs: list[Job]) -> None:
        for job in jobs:
            if job.handle is not None:
                self._tm.abort_request(job.handle)
        self._queued = _unsent(self._queued)  # queued requests end now, unsent

    async def _wait_idle(self) -> None:
        """Wait until SGLang's scheduler is idle (it refuses to release memory otherwise).

        The last outputs reach this process before the scheduler has dropped their finished batch;
        a deferred ``flush_cache`` answers only once the scheduler is fully idle (and flushes the
        radix cache, which a weight update or a KV release needs anyway).
        """
        out = await self._tm.flush_cache(timeout_s=self.idle_timeout_s)
        if not getattr(out, "success", True):
            raise RuntimeError(f"SGLang's scheduler did not become idle: {getattr(out, 'message', '')}")

    async def _engine_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        api = self._api
        await self._wait_idle()
        if "weights" in self._released:
            await self._tm.resume_memory_occupation(api.ResumeMemoryOccupationReqInput(tags=["weights"]), None)
            self._released.discard("weights")
        device = torch.device(self.ctx.device)
        # CUDA tensors travel to the scheduler process as CUDA IPC handles (no copy through the host)
        tensors = [(name, t.detach().to(device=device, dtype=self.ctx.dtype)) for name, t in named_tensors]
        payload = [api.serialize(tensors) for _ in range(self.config.tensor_parallel_size)]
        obj = api.UpdateWeightsFromTensorReqInput(serialized_named_tensors=payload, load_format=None, flush_cache=True)
        success, message = await self._tm.update_weights_from_tensor(obj, None)
        del tensors, payload  # the scheduler has loaded them (the call returned)
        if not success:
            raise RuntimeError(f"SGLang update_weights_from_tensor failed: {message}")

    async def _engine_sleep(self, level: int) -> None:
        await self._wait_idle()
        tags = ["kv_cache"] if level == 1 else ["kv_cache", "weights", "cuda_graph"]
        await self._tm.release_memory_occupation(self._api.ReleaseMemoryOccupationReqInput(tags=tags), None)
        self._released.update(tags)

    async def _engine_wake_up(self) -> None:
        if self._released:
            tags = [t for t in ("cuda_graph", "weights", "kv_cache") if t in self._released]
            await self._tm.resume_memory_occupation(self._api.ResumeMemoryOccupationReqInput(tags=tags), None)
            self._released.clear()

    async def _engine_shutdown(self) -> None:
        engine, self._sgl = self._sgl, None
        if engine is None:
            return
        # Engine.shutdown() kills every child process of this process (rlcli's judge workers too);
        # end only the processes this engine started, after stopping its crash watchdog (it would
        # SIGQUIT this process when they exit).
        watchdog = getattr(self._tm, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()
        atexit.unregister(engine.shutdown)
        try:
            pids = list(engine.get_all_child_pids())
        except Exception:
            log.warning("SGLang engine: child pids unknown; using Engine.shutdown()", exc_info=True)
            engine.shutdown()
            return
        _kill_process_trees(pids)
        self._tm = None


@dataclass
class _Queued:
    """A non-streamed SGLang request waiting for the next batch."""

    job: Job
    prompt: list[int]
    sampling: dict[str, Any]
    rid: str
    answer: asyncio.Future


def _answer(q: _Queued, result: Any) -> None:
    if not q.answer.done():  # its caller may have been cancelled
        q.answer.set_result(result)


def _unsent(batch: list[_Queued]) -> list[_Queued]:
    """The queued requests still to send. Aborted ones are answered with their rid at once (SGLang
    never saw it: ``_run_phase`` then reports "abort")."""
    live = []
    for q in batch:
        if q.job.aborted:
            _answer(q, q.rid)
        elif not q.answer.done():  # else its caller was cancelled
            live.append(q)
    return live


def _finished(job: Job, out: Any) -> tuple[str, str | None]:
    """Add the tokens of a non-streamed request's output to ``job``; its finish reason."""
    ids, lps, ftype, message = parse_output(out, with_logprobs=job.params.return_logprob)
    job.add(ids, lps)
    return finish_reason(ftype, message)


def _failed(job: Job, exc: Exception) -> tuple[str, str | None]:
    """The finish of a request that raised. SGLang raises ValueError for rejected input and for
    requests aborted before they were scheduled, HTTPException for engine-side failures."""
    if job.aborted:
        return "abort", None
    return "error", f"{type(exc).__name__}: {exc}"


def _kill_process_trees(pids: list[int], timeout: float = 60.0) -> None:
    """Kill processes and their descendants and wait for them (GPU memory is freed when they exit)."""
    import psutil

    procs = []
    for pid in pids:
        try:
            parent = psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
        procs += parent.children(recursive=True) + [parent]
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    if alive:
        log.warning("SGLang engine processes still alive after %.0f s: %s", timeout, [p.pid for p in alive])


SGLangBackend.__doc__ = f"SGLang engine, offline ({ENGINE.describe()}).\n" + _DOC
