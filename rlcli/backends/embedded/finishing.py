"""Finishing sequences: collecting their outputs and compacting the rows that stay active."""

from __future__ import annotations

import numpy as np
import torch

from rlcli.backends.base import GenerateOutput
from rlcli.backends.embedded.kv_cache import KVCache
from rlcli.backends.embedded.state import RowState, Sequence


class Finishing(RowState):
    """The part of :class:`~rlcli.backends.embedded.engine.EmbeddedEngine` that ends sequences:
    their tokens, logprobs and versions leave the device buffers, and the last active rows move
    into the freed rows so that active rows stay ``0..B-1``."""

    device: torch.device
    cache: KVCache

    def _finish_where_done(self, rows_np: np.ndarray, stop: np.ndarray, done: list) -> None:
        finished = stop | (self._h_gen[rows_np] >= self._h_max_new[rows_np])
        if finished.any():
            done += self._finish(rows_np[finished])

    def _finish(
        self, rows_np: np.ndarray, reason: str | None = None, error: str | None = None
    ) -> list[tuple[Sequence, GenerateOutput]]:
        """Collect the outputs of ``rows_np`` (sorted row indices) and free their rows."""
        with torch.profiler.record_function("rlcli/engine/finish"):  # a named range in profiler traces
            gens = self._h_gen[rows_np]
            longest = int(gens.max()) if len(gens) else 0
            if longest > 0:
                idx = torch.as_tensor(rows_np, dtype=torch.int64).to(self.device, non_blocking=True)
                toks = self._out_tok[idx, :longest].cpu().tolist()
                # the logprobs cross to the host only for requests that asked (return_logprob)
                asked = any(self._rows[r].params.return_logprob for r in rows_np.tolist())
                lps = self._out_lp[idx, :longest].cpu().tolist() if asked else None
                vers = self._out_ver[idx, :longest].cpu().tolist()
            else:
                toks = lps = vers = [[] for _ in range(len(rows_np))]
            out = []
            for i, r in enumerate(rows_np.tolist()):
                seq = self._rows[r]
                g = int(gens[i])
                tokens = toks[i][:g]
                why = reason
                if why is None:
                    why = "stop" if tokens and tokens[-1] in seq.stop_set else "length"
                lp = lps[i][:g] if seq.params.return_logprob else []
                out.append((seq, GenerateOutput(tokens, lp, vers[i][:g], why, error)))
            self._compact(rows_np)
            return out

    def _compact(self, finished_rows: np.ndarray) -> None:
        """Free ``finished_rows`` and move the last active rows into the holes, so that active
        rows stay ``0..B-1``."""
        b = self._active
        fin = set(finished_rows.tolist())
        new_b = b - len(fin)
        holes = [r for r in sorted(fin) if r < new_b]
        movers = [r for r in range(new_b, b) if r not in fin]
        for r in fin:
            seq = self._rows[r]
            if seq is not None:
                seq.row = None
        if holes:
            dst_np, src_np = np.array(holes), np.array(movers)
            dst = torch.as_tensor(dst_np).to(self.device, non_blocking=True)
            src = torch.as_tensor(src_np).to(self.device, non_blocking=True)
            self.cache.move_rows(dst, src, int(self._h_ctx[src_np].max()))
            for t in (self._ints, self._floats, self._stop_tab):
                t[dst] = t[src]
            g = int(self._h_gen[src_np].max())
            if g > 0:
                for t in (self._out_tok, self._out_lp, self._out_ver):
                    t[dst, :g] = t[src, :g]
            for a in (
                self._h_ctx, self._h_gen, self._h_max_new, self._h_min_new,
                self._h_top_k, self._h_top_p, self._h_temp, self._h_greedy, self._h_has_stop, self._h_flag_src,
                self._h_prefix_id, self._h_prefix_len,
            ):  # fmt: skip
                a[dst_np] = a[src_np]
            for h, m in zip(holes, movers):
                seq = self._rows[m]
                self._rows[h] = seq
                seq.row = h
        for r in range(new_b, b):
            self._rows[r] = None
        self._h_prefix_id[new_b:b] = -1
        self._active = new_b
        self._prefix_stale = True
