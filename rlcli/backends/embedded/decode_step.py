"""The engine's decode step: one token for every active row, on bucketed shapes (CUDA graphs) or
exact ones, with shared prompt rows for Triton attention and, on GPU, overlapped stop flags."""

from __future__ import annotations

import logging

import numpy as np
import torch

from rlcli.backends.embedded.cuda_graphs import CudaGraphDecoder
from rlcli.backends.embedded.finishing import Finishing
from rlcli.backends.embedded.kv_cache import KVCache
from rlcli.backends.embedded.model import LlamaFamilyModel
from rlcli.backends.embedded.row_sampling import RowSampling
from rlcli.backends.embedded.state import _CTX, _TOK

log = logging.getLogger(__name__)


class DecodeStep(RowSampling, Finishing):
    """The part of :class:`~rlcli.backends.embedded.engine.EmbeddedEngine` that runs a decode step
    over rows ``0..B-1`` and finishes the rows that stopped."""

    model: LlamaFamilyModel
    cache: KVCache
    cuda_graphs: CudaGraphDecoder | None
    device: torch.device
    max_batch_size: int
    max_model_len: int
    shape_stable_decode: bool
    overlap: bool

    def _decode_shape(self, active: int, key_len: int) -> tuple[int, int]:
        """Rows and key length the decode forward runs on.

        Shape-stable mode (CUDA graphs) pads the rows to 1, 2, 4, ..., 32 and then multiples of
        32, and the key length to a multiple of 128 up to 1024, of 512 up to 4096, then a power of
        two: few distinct shapes, so few graphs, and little attention over padding. Otherwise on
        CUDA only the key length is rounded up to a multiple of 128 (some attention kernels build
        a plan per shape); on CPU shapes are exact.
        """
        if self.shape_stable_decode:
            rows = 1 << (active - 1).bit_length() if active <= 32 else -(-active // 32) * 32
            if key_len <= 1024:
                keys = -(-key_len // 128) * 128
            elif key_len <= 4096:
                keys = -(-key_len // 512) * 512
            else:
                keys = 1 << (key_len - 1).bit_length()
        else:
            rows = active
            keys = -(-key_len // 128) * 128 if self.device.type == "cuda" else key_len
        return min(rows, self.max_batch_size), min(keys, self.max_model_len)

    def reset_cuda_graphs(self) -> None:
        """Forget captured graphs (after the KV cache or the weights were reallocated)."""
        if self.cuda_graphs is not None:
            self.cuda_graphs.reset()

    def _decode(self, done: list) -> int:
        b = self._active
        key_len = int(self._h_ctx[:b].max()) + 1
        rows, key_len = self._decode_shape(b, key_len)
        tokens = self._ints[:rows, _TOK]
        positions = self._ints[:rows, _CTX]
        if rows > b:  # padding rows are free rows: keep their (stale) state in range
            positions = positions.clamp(max=key_len - 1)
        prefix = None
        if self.model.triton_attention:
            if self._prefix_stale:
                self._write_prefix_rows(b)
            prefix = (self._prefix_rows[:rows], self._prefix_lens[:rows])
        if self.cuda_graphs is not None:
            try:
                logits = self.cuda_graphs(tokens, positions, key_len)[:b]
            except Exception:  # capture is an optimisation: fall back to eager for good
                log.warning("CUDA graph capture failed; decoding without CUDA graphs", exc_info=True)
                self.cuda_graphs = None
                logits = self.model.decode(tokens, positions, self.cache, key_len, prefix=prefix)[:b]
        else:
            logits = self.model.decode(tokens, positions, self.cache, key_len, prefix=prefix)[:b]
        self._ints[:b, _CTX] += 1
        self._h_ctx[:b] += 1
        rows_np = np.arange(b)
        stop = self._sample_and_record(logits, 0, b)
        if not self.overlap:
            self._finish_where_done(rows_np, stop.cpu().numpy(), done)
            return b
        # Issue this step's flags, then read the previous step's (by now computed, or nearly):
        # the GPU already has this step queued while the host finishes rows and prepares the
        # next one. A row that sampled a stop token in the previous step has been decoded once
        # more in this one; that token is dropped (its length goes back by one).
        previous = self._h_flag_src[:b].copy()
        self._h_flag_src[:b] = rows_np
        old = self._issue_flags(stop)
        stopped = self._read_flags(old, previous)
        extra = int(stopped.sum())
        self._h_gen[:b] -= stopped
        self._finish_where_done(rows_np, stopped, done, defer=True)
        return b - extra

    def _write_prefix_rows(self, b: int) -> None:
        """Point each active row at the first active row holding the same admitted prompt (itself
        when it is the first). Any row of the group would do: each holds its own copy of the
        prompt's keys and values, written once at admission and never changed by decoding."""
        ids = self._h_prefix_id[:b]
        _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
        src = first[inverse.reshape(-1)]
        src = np.where(ids >= 0, src, np.arange(b))
        lens = np.where(ids >= 0, self._h_prefix_len[:b], 0)
        self._prefix_rows[:b].copy_(torch.from_numpy(src.astype(np.int64)), non_blocking=True)
        self._prefix_lens[:b].copy_(torch.from_numpy(lens.astype(np.int32)), non_blocking=True)
        self._prefix_stale = False

    def _issue_flags(self, stop: torch.Tensor) -> int:
        """Start copying ``stop`` (device bools, rows ``0..len-1``) into the free host buffer, make
        it the pending one, and return the index of the buffer pending before."""
        old, new = self._flag_pending, 1 - self._flag_pending
        self._flag_bufs[new][: stop.shape[0]].copy_(stop, non_blocking=True)
        if self._flag_events[new] is not None:
            # on the engine device's stream: the worker thread's current device may be another one
            self._flag_events[new].record(torch.cuda.current_stream(self.device))
        self._flag_pending = new
        return old

    def _read_flags(self, buf: int, src: np.ndarray) -> np.ndarray:
        """Host bools: the flag at ``src[i]`` of buffer ``buf`` (False where ``src[i] < 0``)."""
        out = np.zeros(len(src), dtype=bool)
        have = src >= 0
        if have.any():
            if self._flag_events[buf] is not None:
                self._flag_events[buf].synchronize()
            out[have] = self._flag_bufs[buf].numpy()[src[have]]
        return out

    def _finish_pending_stops(self, done: list) -> None:
        """Finish the rows whose last decode step sampled a stop token not read yet (before
        anything else ends the running rows)."""
        b = self._active
        if b == 0:
            return
        stopped = self._read_flags(self._flag_pending, self._h_flag_src[:b])
        self._h_flag_src[:b] = -1
        if stopped.any():
            done += self._finish(np.arange(b)[stopped])
