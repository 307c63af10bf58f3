"""The embedded engine's per-row state: its requests (:class:`Sequence`), the device tensors a
step reads and writes, and their host mirrors (:class:`RowState`).

Row ``r`` of every buffer belongs to the sequence in KV-cache row ``r``; active sequences occupy
rows ``0..B-1`` (see :mod:`rlcli.backends.embedded.kv_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rlcli.backends.base import GenerateRequest
from rlcli.types import SampleParams

# columns of the per-row int64 state
_TOK, _CTX, _GEN, _MIN_NEW, _TOP_K, _KEY1, _KEY2, _HAS_STOP, _GREEDY = range(9)
_N_INT = 9
# columns of the per-row float32 state
_TEMP, _TOP_P = range(2)
_N_FLOAT = 2


@dataclass(eq=False)
class Sequence:
    """One request inside the engine."""

    request: GenerateRequest
    prompt: list[int]
    params: SampleParams
    key1: int
    key2: int
    stop_ids: list[int]  # eos (unless ignore_eos) + stop_token_ids, deduplicated
    max_new: int  # max_tokens capped by max_model_len - prompt length
    future: Any = None  # asyncio.Future set by the backend
    cancelled: bool = False
    row: int | None = None
    stop_set: frozenset = field(default_factory=frozenset)

    def __post_init__(self):
        self.stop_set = frozenset(self.stop_ids)


class RowState:
    """Per-row buffers of the engine's batch of ``rows`` sequences of at most ``max_len`` tokens.

    The base of :class:`~rlcli.backends.embedded.engine.EmbeddedEngine` and of its parts
    (admission, decode step, row sampling, finishing), which all read and write these buffers.
    """

    def __init__(self, rows: int, max_len: int, device: torch.device, version: int):
        n, dev = rows, device
        with torch.inference_mode():
            self._ints = torch.zeros(n, _N_INT, dtype=torch.int64, device=dev)
            self._floats = torch.ones(n, _N_FLOAT, dtype=torch.float32, device=dev)
            self._stop_tab = torch.zeros(n, 1, dtype=torch.int64, device=dev)
            self._out_tok = torch.zeros(n, max_len, dtype=torch.int64, device=dev)
            self._out_lp = torch.zeros(n, max_len, dtype=torch.float32, device=dev)
            self._out_ver = torch.zeros(n, max_len, dtype=torch.int64, device=dev)
            self._version_t = torch.tensor(int(version), dtype=torch.int64, device=dev)
            # Shared prompts (Triton attention): row r reads its first _prefix_lens[r] keys and
            # values from cache row _prefix_rows[r], the first row holding the same prompt from the
            # same admission, so a group's prompt is read from memory once per step and from the
            # L2 cache by its other rows. Fixed addresses: CUDA graphs read them at replay.
            self._prefix_rows = torch.arange(n, dtype=torch.int64, device=dev)
            self._prefix_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self._version = int(version)
        self._h_prefix_id = np.full(n, -1, dtype=np.int64)  # which admitted prompt a row holds (-1: none)
        self._h_prefix_len = np.zeros(n, dtype=np.int64)
        self._prefix_ids = 0
        self._prefix_stale = False  # rows changed since _prefix_rows / _prefix_lens were written
        # host mirrors of per-row state (numpy, vectorised; no per-token Python loops)
        self._h_ctx = np.zeros(n, dtype=np.int64)
        self._h_gen = np.zeros(n, dtype=np.int64)
        self._h_max_new = np.zeros(n, dtype=np.int64)
        self._h_min_new = np.zeros(n, dtype=np.int64)
        self._h_top_k = np.zeros(n, dtype=np.int64)
        self._h_top_p = np.ones(n, dtype=np.float64)
        self._h_temp = np.ones(n, dtype=np.float64)  # effective temperature (1.0 for greedy)
        self._h_greedy = np.zeros(n, dtype=bool)
        self._h_has_stop = np.zeros(n, dtype=bool)
        # Overlapped decode (``overlap``): a decode step's "sampled a stop token" flags are copied
        # to the host asynchronously and read only after the next step has been launched, so the
        # GPU never waits for the host between steps. _h_flag_src[r] is where row r's unread flag
        # is in the pending host buffer (-1: none); it moves with the row when rows are compacted.
        self._h_flag_src = np.full(n, -1, dtype=np.int64)
        pin = dev.type == "cuda"
        self._flag_bufs = [torch.zeros(n, dtype=torch.bool, pin_memory=pin) for _ in range(2)]
        self._flag_events = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._flag_pending = 0  # index of the buffer that _h_flag_src refers to
        self._rows: list[Sequence | None] = [None] * n
        self._active = 0  # rows 0.._active-1 hold running sequences
