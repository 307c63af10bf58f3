"""Admission: waiting requests move into free rows, their prompts are prefilled (identical prompts
admitted together once, their keys and values written to every copy's row) and each row's first
token is sampled."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import numpy as np
import torch

from rlcli.backends.embedded.finishing import Finishing
from rlcli.backends.embedded.kv_cache import KVCache
from rlcli.backends.embedded.model import LlamaFamilyModel
from rlcli.backends.embedded.row_sampling import RowSampling
from rlcli.backends.embedded.state import Sequence

# (prompt, rows that hold a copy of it)
_PromptGroup = tuple[list[int], list[int]]


class Admission(RowSampling, Finishing):
    """The part of :class:`~rlcli.backends.embedded.engine.EmbeddedEngine` that admits waiting
    requests into rows ``B..`` (prompts prefilled in padded batches of at most
    ``max_prefill_tokens``)."""

    model: LlamaFamilyModel
    cache: KVCache
    device: torch.device
    max_batch_size: int
    max_prefill_tokens: int
    prefix_sharing: bool
    pad_token_id: int
    _waiting: deque[Sequence]
    _qlock: threading.Lock
    _stats_lock: threading.Lock
    _stats: dict[str, float]

    def _ensure_stop_width(self, width: int) -> None:
        old = self._stop_tab.shape[1]
        if width > old:  # widen, padding each row with repeats of its first entry
            extra = self._stop_tab[:, :1].expand(-1, width - old)
            self._stop_tab = torch.cat([self._stop_tab, extra], dim=1).contiguous()

    def _admit(self, done: list) -> int:
        """Admit what fits of the waiting requests; returns how many (each has its first token)."""
        seqs = self._take_waiting()
        if not seqs:
            return 0
        n, b0 = len(seqs), self._active
        self._place(seqs, b0)
        uniques = self._group_prompts(seqs, b0)
        logits_rows, computed = self._prefill(uniques, n, b0)
        with self._stats_lock:
            self._stats["prefill_tokens"] += computed
            self._stats["shared_prefill_tokens"] += sum(len(s.prompt) for s in seqs) - computed
        rows_np = np.arange(b0, b0 + n)
        stop = self._sample_and_record(logits_rows, b0, b0 + n)
        self._finish_where_done(rows_np, stop.cpu().numpy(), done)
        return n

    def _take_waiting(self) -> list[Sequence]:
        """Pop waiting sequences (skipping cancelled ones) while rows are free."""
        free = self.max_batch_size - self._active
        seqs: list[Sequence] = []
        if free > 0 and self._waiting:
            with self._qlock:
                while self._waiting and len(seqs) < free:
                    seq = self._waiting.popleft()
                    if not seq.cancelled:
                        seqs.append(seq)
        return seqs

    def _place(self, seqs: list[Sequence], b0: int) -> None:
        """Give ``seqs`` rows ``b0..``: their device state, host mirrors and the row table."""
        n = len(seqs)
        width = max(1, self._stop_tab.shape[1], max(len(s.stop_ids) for s in seqs))
        self._ensure_stop_width(width)
        ints, floats = [], []
        for i, s in enumerate(seqs):
            r = b0 + i
            s.row = r
            self._rows[r] = s
            p = s.params
            greedy = p.temperature == 0.0
            ints.append(
                [0, len(s.prompt), 0, p.min_tokens, p.top_k, s.key1, s.key2, int(bool(s.stop_ids)), int(greedy)]
            )
            floats.append([1.0 if greedy else float(p.temperature), float(p.top_p)])
        sl = slice(b0, b0 + n)
        dev = self.device
        self._ints[sl] = torch.tensor(ints, dtype=torch.int64).to(dev, non_blocking=True)
        self._floats[sl] = torch.tensor(floats, dtype=torch.float32).to(dev, non_blocking=True)
        self._stop_tab[sl] = _stop_rows(seqs, width).to(dev, non_blocking=True)
        self._h_ctx[sl] = [len(s.prompt) for s in seqs]
        self._h_gen[sl] = 0
        self._h_max_new[sl] = [s.max_new for s in seqs]
        self._h_min_new[sl] = [s.params.min_tokens for s in seqs]
        self._h_top_k[sl] = [s.params.top_k for s in seqs]
        self._h_top_p[sl] = [s.params.top_p for s in seqs]
        self._h_temp[sl] = [s.params.temperature or 1.0 for s in seqs]
        self._h_greedy[sl] = [s.params.temperature == 0.0 for s in seqs]
        self._h_has_stop[sl] = [bool(s.stop_ids) for s in seqs]
        self._h_flag_src[sl] = -1
        self._active = b0 + n

    def _group_prompts(self, seqs: list[Sequence], b0: int) -> list[_PromptGroup]:
        """The distinct prompts among ``seqs`` (rows ``b0..``) with their rows, longest first
        (prefix sharing: one prefill per distinct prompt); records which rows share a prompt."""
        groups: dict[Any, _PromptGroup] = {}
        for i, s in enumerate(seqs):
            key = tuple(s.prompt) if self.prefix_sharing else i
            groups.setdefault(key, (s.prompt, []))[1].append(b0 + i)
        for prompt, rows in groups.values():  # rows that may read one copy of the prompt's keys and values
            self._prefix_ids += 1
            self._h_prefix_id[rows] = self._prefix_ids
            self._h_prefix_len[rows] = len(prompt)
        self._prefix_stale = True
        return sorted(groups.values(), key=lambda g: -len(g[0]))

    def _prefill(self, uniques: list[_PromptGroup], n: int, b0: int) -> tuple[torch.Tensor, int]:
        """Prefill ``uniques`` (longest first) in padded chunks of at most ``max_prefill_tokens``
        into their rows; returns the float32 logits of rows ``b0..b0+n-1`` and the prompt tokens
        computed."""
        dev = self.device
        logits_rows = torch.empty(n, self.model.vocab_size, dtype=torch.float32, device=dev)
        computed = 0
        start = 0
        while start < len(uniques):
            length = len(uniques[start][0])  # longest in the chunk (sorted descending)
            count = max(1, min(len(uniques) - start, self.max_prefill_tokens // length))
            chunk = uniques[start : start + count]
            start += count
            ids = [p + [self.pad_token_id] * (length - len(p)) for p, _ in chunk]
            dest = [r for _, rows in chunk for r in rows]
            src = [j for j, (_, rows) in enumerate(chunk) for _ in rows]
            last = [len(p) - 1 for p, _ in chunk]
            dest_t = torch.tensor(dest, dtype=torch.int64).to(dev, non_blocking=True)
            src_t = torch.tensor(src, dtype=torch.int64).to(dev, non_blocking=True)
            logits = self.model.prefill(
                torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True),
                torch.tensor(last, dtype=torch.int64).to(dev, non_blocking=True),
                self.cache,
                dest_t,
                src_t,
            )
            logits_rows[dest_t - b0] = logits[src_t]
            computed += sum(len(p) for p, _ in chunk)
        return logits_rows, computed


def _stop_rows(seqs: list[Sequence], width: int) -> torch.Tensor:
    """The stop-id table rows of ``seqs``, each padded to ``width`` with its first id. Requests
    mostly share one list (the model's EOS ids, hundreds for some models), so each distinct list
    becomes a tensor row once and the rows are gathered."""
    distinct: dict[tuple[int, ...], int] = {}
    which = [distinct.setdefault(tuple(s.stop_ids or (0,)), len(distinct)) for s in seqs]
    table = torch.tensor([[*ids, *(ids[0],) * (width - len(ids))] for ids in distinct], dtype=torch.int64)
    return table[torch.tensor(which, dtype=torch.int64)]
