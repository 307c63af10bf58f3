"""Choosing each row's next token on the device and appending it to the row's output buffers."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from rlcli.backends.embedded.sampling import counter_uniform, filter_top_k_top_p, sample_tokens
from rlcli.backends.embedded.state import (
    _CTX, _GEN, _GREEDY, _HAS_STOP, _KEY1, _KEY2, _MIN_NEW, _TEMP, _TOK, _TOP_K, _TOP_P, RowState,
)


class RowSampling(RowState):
    """The part of :class:`~rlcli.backends.embedded.engine.EmbeddedEngine` that samples the next
    token of a range of rows (after prefill or a decode step) and records it. ``_sample_plain``
    (set by the engine: :func:`~rlcli.backends.embedded.sampling.sample_plain_keyed`, possibly
    compiled) serves the common case of plain sampling; :meth:`_sample_general` the rest."""

    _sample_plain: Callable[..., tuple[torch.Tensor, torch.Tensor]]

    def _sample_general(self, logits, ints, floats, unit_temp, stop_tab, has_stop, suppress_np, greedy_np,
                        top_k_np, use_top_p) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampling with min-token stop suppression, greedy rows and top-k / top-p filtering.

        The logprob is that of the chosen token under the temperature-scaled distribution before
        any filtering (what the trainer recomputes)."""
        scaled = logits.float()
        if not unit_temp:
            scaled = scaled / floats[:, _TEMP].unsqueeze(1)
        lse = torch.logsumexp(scaled, dim=-1)
        choice = scaled
        if suppress_np.any():
            suppress = (ints[:, _GEN] < ints[:, _MIN_NEW]) & has_stop
            current = choice.gather(1, stop_tab)
            choice = choice.scatter(1, stop_tab, current.masked_fill(suppress[:, None], float("-inf")))
        if greedy_np.all():
            tok = choice.argmax(dim=-1)
        else:
            filtered = choice
            if use_top_p or np.any(top_k_np > 0):
                filtered = filter_top_k_top_p(
                    choice, ints[:, _TOP_K], floats[:, _TOP_P], use_top_p=use_top_p, max_top_k=int(top_k_np.max())
                )
            uniform = counter_uniform(ints[:, _KEY1], ints[:, _KEY2], ints[:, _CTX])
            tok = sample_tokens(filtered, uniform)
            if greedy_np.any():
                tok = torch.where(ints[:, _GREEDY] == 1, choice.argmax(dim=-1), tok)
        return tok, scaled.gather(1, tok[:, None]).squeeze(1) - lse

    def _sample_and_record(self, logits: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Choose the next token of rows ``start..end-1`` from ``logits``, append it (with its
        logprob and the current version) to the rows' output buffers, and return "is a stop
        token" as device booleans (nothing here waits for the device). The rows are contiguous,
        so their state is read and written through views: no gathers, few kernel launches."""
        sl = slice(start, end)
        ints, floats, stop_tab = self._ints[sl], self._floats[sl], self._stop_tab[sl]
        unit_temp = bool(np.all(self._h_temp[sl] == 1.0))
        has_stop = ints[:, _HAS_STOP] == 1
        suppress_np = (self._h_gen[sl] < self._h_min_new[sl]) & self._h_has_stop[sl]
        greedy_np = self._h_greedy[sl]
        top_k_np, top_p_np = self._h_top_k[sl], self._h_top_p[sl]
        use_top_p = bool(np.any(top_p_np < 1.0))
        if not (suppress_np.any() or greedy_np.any() or use_top_p or np.any(top_k_np > 0)):
            # the common RL case: plain sampling at some temperature, one fused pass
            tok, logprob = self._sample_plain(logits, None if unit_temp else floats[:, _TEMP],
                                              ints[:, _KEY1], ints[:, _KEY2], ints[:, _CTX])
        else:
            tok, logprob = self._sample_general(logits, ints, floats, unit_temp, stop_tab, has_stop, suppress_np,
                                                greedy_np, top_k_np, use_top_p)

        gen = ints[:, _GEN : _GEN + 1]  # a view: read by the scatters below before the increment
        self._out_tok[sl].scatter_(1, gen, tok[:, None])
        self._out_lp[sl].scatter_(1, gen, logprob[:, None])
        self._out_ver[sl].scatter_(1, gen, self._version_t.expand(end - start, 1))
        ints[:, _GEN] += 1
        ints[:, _TOK] = tok
        self._h_gen[sl] += 1
        return has_stop & (tok[:, None] == stop_tab).any(dim=-1)
