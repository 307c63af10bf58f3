"""The embedded engine's synchronous continuous-batching scheduler.

One :meth:`EmbeddedEngine.step` admits waiting requests into free rows
(:mod:`~rlcli.backends.embedded.admission`: their prompts are prefilled in padded batches of at
most ``max_prefill_tokens``; identical prompts admitted together - the ``prompt_repeat_k`` copies
of a group - are prefilled once and their KV written to every copy's row), then runs one batched
decode step for all active rows (:mod:`~rlcli.backends.embedded.decode_step`). Sampling happens
on the device (:mod:`~rlcli.backends.embedded.row_sampling`); the only device-to-host transfer of
a decode step is one boolean per row ("sampled a stop token"), and token ids, logprobs and
versions stay in device buffers until a sequence finishes (:mod:`~rlcli.backends.embedded.finishing`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Iterable

import numpy as np
import torch

from rlcli.backends.base import GenerateOutput, GenerateRequest
from rlcli.backends.embedded.admission import Admission
from rlcli.backends.embedded.cuda_graphs import CudaGraphDecoder
from rlcli.backends.embedded.decode_step import DecodeStep
from rlcli.backends.embedded.finishing import FinishedRows
from rlcli.backends.embedded.kv_cache import KVCache
from rlcli.backends.embedded.model import LlamaFamilyModel
from rlcli.backends.embedded.sampling import sample_plain_keyed, seed_keys
from rlcli.backends.embedded.state import Sequence
from rlcli.backends.engine_runtime.helpers import stop_ids_for
from rlcli.compiling import compile_rows_dynamic
from rlcli.types import SampleParams

log = logging.getLogger(__name__)


class EmbeddedEngine(Admission, DecodeStep):
    """The synchronous continuous-batching scheduler behind
    :class:`~rlcli.backends.embedded.backend.EmbeddedBackend`.

    Not thread-safe: :meth:`step`, :meth:`abort_all` and weight/cache changes must be
    serialised by the caller (the backend holds one lock around them). :meth:`submit` and
    :meth:`cancel` may be called from any thread at any time.
    """

    def __init__(
        self,
        model: LlamaFamilyModel,
        *,
        max_batch_size: int,
        max_model_len: int,
        max_prefill_tokens: int,
        eos_token_ids: Iterable[int],
        prefix_sharing: bool = True,
        kv_cache_dtype: torch.dtype | None = None,
        pad_token_id: int | None = None,
        version: int = 0,
        shape_stable_decode: bool = False,
        overlap: bool | None = None,
    ):
        self.model = model
        self.device = model.device
        self.max_batch_size = int(max_batch_size)
        self.max_model_len = int(max_model_len)
        self.max_prefill_tokens = int(max_prefill_tokens)
        self.prefix_sharing = bool(prefix_sharing)
        self.eos_token_ids = [int(e) for e in eos_token_ids]
        self.shape_stable_decode = bool(shape_stable_decode)
        # CPU ops run synchronously, so there is nothing to overlap there, and the extra decode
        # step of a row that stopped would only cost time (much of it with short responses)
        self.overlap = self.device.type == "cuda" if overlap is None else bool(overlap)
        self.cuda_graphs: CudaGraphDecoder | None = None
        vocab = model.vocab_size
        self.pad_token_id = pad_token_id if pad_token_id is not None and 0 <= pad_token_id < vocab else 0
        self.cache = KVCache(
            len(model.layers),
            self.max_batch_size,
            model.num_kv_heads,
            self.max_model_len,
            model.head_dim,
            kv_cache_dtype or model.dtype,
            self.device,
        )
        super().__init__(self.max_batch_size, self.max_model_len, self.device, version)
        self._waiting: deque[Sequence] = deque()
        self._cancelled: deque[Sequence] = deque()
        self._qlock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._stats = self._zero_stats()
        self._captures_read = 0
        self._done: list[tuple[Sequence, GenerateOutput]] = []
        self._in_flight: deque[FinishedRows] = deque()  # finished rows whose outputs are being copied
        #: Steps in lockstep with the caller's event loop (``rlcli.lockstep``; the backend sets it):
        #: the requests that arrived since the last step are admitted in an order of their own
        #: (request id, then seed), not in the order the loop's tasks happened to submit them, and
        #: finished rows' outputs come out at lockstep boundaries only (``at_lockstep_boundary``).
        self.lockstep = False
        self._step_index = 0
        self._busy_steps = 0  # steps since the engine last ran out of work: lockstep's boundaries count these
        self._ordered_waiting = 0  # lockstep: the waiting sequences already put in order
        if self.shape_stable_decode and self.device.type == "cuda" and CudaGraphDecoder.supported(model):
            self.cuda_graphs = CudaGraphDecoder(model, self.cache, self.max_batch_size,
                                                prefix=(self._prefix_rows, self._prefix_lens))
        self._sample_plain = sample_plain_keyed

    def compile_sampler(self) -> None:
        """Run the plain-sampling path through ``torch.compile`` (fused passes over the logits);
        a failed compilation falls back to eager PyTorch for good."""
        compiled = compile_rows_dynamic(sample_plain_keyed)  # row count symbolic, vocabulary constant

        def sample(*args):
            try:
                return compiled(*args)
            except Exception:
                log.warning("torch.compile of the sampler failed; sampling eagerly from now on", exc_info=True)
                self._sample_plain = sample_plain_keyed
                return sample_plain_keyed(*args)

        self._sample_plain = sample

    # -------------------------------------------------------------------------- state
    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = int(version)
        with torch.inference_mode():
            self._version_t.fill_(self._version)

    @property
    def num_active(self) -> int:
        return self._active

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        return self._active > 0 or bool(self._waiting) or bool(self._cancelled) or bool(self._in_flight)

    @staticmethod
    def _zero_stats() -> dict[str, float]:
        return {"generated_tokens": 0, "prefill_tokens": 0, "shared_prefill_tokens": 0, "busy_s": 0.0, "steps": 0}

    def pop_stats(self) -> dict[str, float]:
        """Counters since the last call (reset on read) plus the current queue gauges."""
        with self._stats_lock:
            out, self._stats = self._stats, self._zero_stats()
            if self.cuda_graphs is not None:
                captures = self.cuda_graphs.captures
                out["cuda_graph_captures"] = captures - self._captures_read
                self._captures_read = captures
        out["running"] = self._active
        out["waiting"] = len(self._waiting)
        return out

    # -------------------------------------------------------------------------- requests
    def validate(self, request: GenerateRequest) -> str | None:
        """Why ``request`` cannot be served (an ``error`` message), or None if it can."""
        prompt = request.prompt_ids
        if not isinstance(request.params, SampleParams):
            return f"params must be a SampleParams, got {type(request.params).__name__}"
        if len(prompt) == 0:
            return "empty prompt: at least one prompt token is required"
        if len(prompt) >= self.max_model_len:
            return (
                f"prompt has {len(prompt)} tokens but max_model_len is {self.max_model_len}; "
                f"the prompt must leave room for at least one generated token"
            )
        vocab = self.model.vocab_size
        if set(map(type, prompt)) <= {int} and 0 <= min(prompt) and max(prompt) < vocab:
            return None  # the common case, without a Python-level loop per token
        bad = [t for t in prompt if not isinstance(t, (int, np.integer)) or not 0 <= int(t) < vocab]
        if bad:
            return f"prompt token ids out of range [0, {vocab}): {bad[:8]}"
        return None

    def make_sequence(self, request: GenerateRequest, seed: int) -> Sequence:
        """Wrap a validated request; ``seed`` is used when the request carries none."""
        p = request.params
        stop_ids = stop_ids_for(p, self.eos_token_ids)
        prompt = list(map(int, request.prompt_ids))
        k1, k2 = seed_keys(int(request.seed) if request.seed is not None else int(seed))
        max_new = min(p.max_tokens, self.max_model_len - len(prompt))
        return Sequence(request, prompt, p, k1, k2, stop_ids, max_new)

    def submit(self, seq: Sequence) -> None:
        with self._qlock:
            self._waiting.append(seq)

    def cancel(self, seq: Sequence) -> None:
        """Drop a sequence at the next step (its caller stopped waiting)."""
        seq.cancelled = True
        self._cancelled.append(seq)

    # -------------------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> list[tuple[Sequence, GenerateOutput]]:
        """Admit + prefill waiting requests, then decode one token for every active row.

        Returns the sequences that finished during the step with their outputs. With ``overlap``
        a sequence whose decode step sampled a stop token is returned by the next step (or by
        :meth:`abort_all`), with exactly the tokens up to that stop token.
        """
        t0 = time.perf_counter()
        self._step_index += 1
        self._busy_steps += 1
        if self.lockstep:
            self._order_arrivals()
        self.cache.allocate()
        # finished outputs collect here (not in a local) so that fail_all() can still return
        # them if the step raises after some sequences finished
        done = self._done = []
        self._reap_cancelled()
        generated = self._admit(done)
        if self._active:
            generated += self._decode(done)
        # outputs copied in earlier steps; all of them once no row runs (nothing left to overlap)
        self._emit_finished(done, wait=not self._active)
        self._done = []
        self._ordered_waiting = len(self._waiting)
        if not self.has_work():
            self._busy_steps = 0
        with self._stats_lock:
            self._stats["generated_tokens"] += generated
            self._stats["steps"] += 1
            self._stats["busy_s"] += time.perf_counter() - t0
        return done

    def _order_arrivals(self) -> None:
        """Lockstep: put the sequences that arrived since the last step in their own order."""
        with self._qlock:
            n = self._ordered_waiting
            if len(self._waiting) > n + 1:
                old = [self._waiting[i] for i in range(n)]
                new = sorted((self._waiting[i] for i in range(n, len(self._waiting))), key=_arrival_order)
                self._waiting = deque(old + new)

    @torch.inference_mode()
    def abort_all(self, reason: str = "abort", error: str | None = None) -> list[tuple[Sequence, GenerateOutput]]:
        """Finish every running sequence with ``reason`` (keeping its tokens so far) and every
        waiting one with no tokens."""
        done: list[tuple[Sequence, GenerateOutput]] = []
        self._emit_finished(done, wait=True)  # sequences that finished before the abort end as they did
        self._finish_pending_stops(done)  # sequences that already ended with a stop token end as such
        if self._active:
            done += self._finish(np.arange(self._active), reason=reason, error=error)
        with self._qlock:
            waiting, self._waiting = list(self._waiting), deque()
            self._ordered_waiting = 0
        self._cancelled.clear()
        self._busy_steps = 0
        done += [(s, GenerateOutput(finish_reason=reason, error=error)) for s in waiting if not s.cancelled]
        return done

    def fail_all(self, error: str) -> list[tuple[Sequence, GenerateOutput]]:
        """After an engine failure: end every sequence with finish "error" without touching the
        device (whose state is unknown) and reset the scheduler so new requests are served."""
        done, self._done = self._done, []
        # rows whose outputs were still being copied: the device's state is unknown, so is their copy
        done += [(s, GenerateOutput(finish_reason="error", error=error)) for fin in self._in_flight for s in fin.seqs]
        self._in_flight.clear()
        done += [(s, GenerateOutput(finish_reason="error", error=error)) for s in self._rows[: self._active] if s]
        with self._qlock:
            waiting, self._waiting = list(self._waiting), deque()
            self._ordered_waiting = 0
        done += [(s, GenerateOutput(finish_reason="error", error=error)) for s in waiting]
        for s, _ in done:
            s.row = None
        self._rows = [None] * self.max_batch_size
        self._active = 0
        self._h_flag_src[:] = -1
        self._cancelled.clear()
        self._busy_steps = 0
        return done

    def _reap_cancelled(self) -> None:
        rows = []
        while self._cancelled:
            seq = self._cancelled.popleft()
            if seq.row is not None and self._rows[seq.row] is seq:
                rows.append(seq.row)
        if rows:
            self._finish(np.array(sorted(set(rows)), dtype=np.int64), reason="abort")


def _arrival_order(seq: Sequence) -> tuple:
    """The order lockstep admits sequences that arrived together in: by request id (the agent
    loops send the sample's uid), then by sampling seed, then by prompt."""
    return (repr(seq.request.request_id), seq.key1, seq.key2, seq.prompt)
