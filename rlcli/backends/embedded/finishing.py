"""Finishing sequences: collecting their outputs and compacting the rows that stay active."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlcli.backends.base import GenerateOutput
from rlcli.backends.embedded.kv_cache import KVCache
from rlcli.backends.embedded.state import RowState, Sequence
from rlcli.lockstep import ENGINE_STEPS


@dataclass(eq=False)
class FinishedRows:
    """Rows that finished together: their sequences, generated counts and end reason, and their
    tokens, logprobs (None unless a request asked) and versions as host tensors. ``ready`` is the
    event recorded after the copies that fill those tensors (None: already filled)."""

    seqs: list[Sequence]
    gens: np.ndarray
    reason: str | None
    error: str | None
    toks: torch.Tensor | None = None
    lps: torch.Tensor | None = None
    vers: torch.Tensor | None = None
    ready: Any = None
    step: int = 0  # the engine step that finished these rows

    def outputs(self) -> list[tuple[Sequence, GenerateOutput]]:
        if self.toks is None:
            toks = lps = vers = [[] for _ in self.seqs]
        else:
            toks, vers = self.toks.tolist(), self.vers.tolist()
            lps = self.lps.tolist() if self.lps is not None else None
        out = []
        for i, seq in enumerate(self.seqs):
            g = int(self.gens[i])
            tokens = toks[i][:g]
            why = self.reason
            if why is None:
                why = "stop" if tokens and tokens[-1] in seq.stop_set else "length"
            lp = lps[i][:g] if seq.params.return_logprob else []
            out.append((seq, GenerateOutput(tokens, lp, vers[i][:g], why, self.error)))
        return out


class Finishing(RowState):
    """The part of :class:`~rlcli.backends.embedded.engine.EmbeddedEngine` that ends sequences:
    their tokens, logprobs and versions leave the device buffers, and the last active rows move
    into the freed rows so that active rows stay ``0..B-1``.

    A finish in the overlapped decode path (``defer``) does not wait for the device: the
    outputs are copied into pinned host memory behind the decode step already queued, and handed
    out by a later step once their event has completed (:meth:`_emit_finished`), as the stop
    flags are. Reading them at once (``.cpu()``) would drain the queue, and the GPU would then
    idle while the host finishes the rows and prepares the next step."""

    device: torch.device
    cache: KVCache
    _in_flight: deque[FinishedRows]
    lockstep: bool
    _step_index: int
    _busy_steps: int  # steps since the engine last ran out of work

    def at_lockstep_boundary(self) -> bool:
        """Whether the step just taken is one where a lockstep engine hands out finishes: a
        multiple of ``ENGINE_STEPS`` steps since the engine last ran out of work (counted so, the
        boundaries are the same in a resumed run as in one never interrupted)."""
        return self._busy_steps % ENGINE_STEPS == 0

    def _finish_where_done(self, rows_np: np.ndarray, stop: np.ndarray, done: list, defer: bool = False) -> None:
        finished = stop | (self._h_gen[rows_np] >= self._h_max_new[rows_np])
        if finished.any():
            done += self._finish(rows_np[finished], defer=defer)

    def _finish(
        self, rows_np: np.ndarray, reason: str | None = None, error: str | None = None, defer: bool = False
    ) -> list[tuple[Sequence, GenerateOutput]]:
        """Collect the outputs of ``rows_np`` (sorted row indices) and free their rows. With
        ``defer`` on CUDA the outputs come later, from :meth:`_emit_finished`."""
        with torch.profiler.record_function("rlcli/engine/finish"):  # a named range in profiler traces
            seqs = [self._rows[r] for r in rows_np.tolist()]
            gens = self._h_gen[rows_np]  # a copy (fancy indexing): compaction rewrites the rows
            longest = int(gens.max()) if len(gens) else 0
            fin = FinishedRows(seqs, gens, reason, error)
            if longest > 0:
                idx = torch.as_tensor(rows_np, dtype=torch.int64).to(self.device, non_blocking=True)
                # the logprobs cross to the host only for requests that asked (return_logprob)
                asked = any(s.params.return_logprob for s in seqs)
                parts = (self._out_tok[idx, :longest], self._out_lp[idx, :longest] if asked else None,
                         self._out_ver[idx, :longest])
                # deferred: into pinned host memory (torch pins a CUDA -> CPU non_blocking copy)
                fin.toks, fin.lps, fin.vers = (None if p is None else p.to("cpu", non_blocking=defer) for p in parts)
                if defer:
                    fin.ready = self._copy_event()
                    fin.step = self._step_index
            self._compact(rows_np)
        if fin.ready is None:
            return fin.outputs()
        self._in_flight.append(fin)
        return []

    def _copy_event(self) -> Any:
        """The event after the copies just queued; None on the CPU, where they are done already."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))  # the engine's device, whatever the thread's
        return event

    def _emit_finished(self, done: list, wait: bool) -> None:
        """Hand out the finished rows whose copies are complete, in the order they finished;
        with ``wait``, all of them (waiting for the device). In ``lockstep``, at its boundaries
        (every :data:`~rlcli.lockstep.ENGINE_STEPS` steps: ``at_lockstep_boundary``), those of
        the earlier steps (waiting for their copies), so that which step hands out a finish does
        not depend on the device's timing, and the host waits for the device once per that many
        steps."""
        while self._in_flight:
            fin = self._in_flight[0]
            if self.lockstep:
                hold = not self.at_lockstep_boundary() or fin.step >= self._step_index
            else:
                hold = not fin.ready.query()
            if hold and not wait:
                return
            fin.ready.synchronize()
            self._in_flight.popleft()
            done += fin.outputs()

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
