"""Log-probs and entropies of label tokens from the LM head, chunk by chunk.

Computed from ``logits / temperature`` (per row) by a fused, chunked ``lm_head`` +
``log_softmax`` (:func:`chunked_logprobs`): only label positions are projected,
``logprob_chunk_size`` rows at a time in float32, and the backward pass recomputes each chunk
instead of keeping ``[tokens, vocab]`` logits alive. When every token's loss gradient is known
before the forward pass (``head_grad_in_forward``; see
:func:`rlcli.train.step_loss.head_grad_ahead`) the head's gradient is computed during the
forward pass instead (:func:`head_value_and_grad_ahead`), so each chunk is projected once.
:class:`PolicyModel` wraps an HF causal LM so that one FSDP2 root forward returns them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rlcli.compiling import compile_rows_dynamic

log = logging.getLogger(__name__)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``hidden @ W.T + b`` of one chunk, in the weight dtype (the softmax math upcasts)."""
    return F.linear(hidden, weight, bias)


def _softmax_stats(logits: torch.Tensor, labels: torch.Tensor, inv_temp: torch.Tensor | None,
                   with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """float32 ``(lse, logprob of label, entropy)`` of ``softmax(logits * inv_temp)``, per row.

    Written as plain tensor math over the whole row so that ``torch.compile`` turns it into two
    passes over the (half-precision) logits: a max, then exp/sum/dot. Entropy uses
    ``H = log s - sum(e * y) / s`` with ``y = x - max``, ``e = exp(y)``, ``s = sum(e)``.
    """
    x = logits.float()
    if inv_temp is not None:
        x = x * inv_temp.unsqueeze(1)
    y = x - x.amax(dim=-1, keepdim=True)
    e = y.exp()
    s = e.sum(dim=-1)
    log_s = s.log()
    lse = x.amax(dim=-1) + log_s
    logp = y.gather(1, labels.unsqueeze(1)).squeeze(1) - log_s
    ent = log_s - (e * y).sum(dim=-1) / s if with_entropy else None
    return lse, logp, ent


def _dlogits(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, g: torch.Tensor,
             inv_temp: torch.Tensor | None) -> torch.Tensor:
    """``d(g * logp[label]) / d logits = g * (onehot(label) - softmax) * inv_temp`` in the logits dtype.

    ``g``: float32 ``[n]`` upstream gradient, already multiplied by ``inv_temp``. Written with a
    one-hot comparison so that ``torch.compile`` makes it one pointwise pass (see
    :func:`_dlogits_eager` for the eager form).
    """
    x = logits.float()
    if inv_temp is not None:
        x = x * inv_temp.unsqueeze(1)
    p = (x - lse.unsqueeze(1)).exp()
    cols = torch.arange(x.shape[1], device=x.device)
    onehot = (cols.unsqueeze(0) == labels.unsqueeze(1)).to(x.dtype)
    return ((onehot - p) * g.unsqueeze(1)).to(logits.dtype)


def _dlogits_eager(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, g: torch.Tensor,
                   inv_temp: torch.Tensor | None) -> torch.Tensor:
    """:func:`_dlogits` in place in one float32 buffer, without a ``[n, vocab]`` one-hot (eager).
    ``logits`` is a chunk's temporary: when it is float32 already it is overwritten."""
    x = logits.float()
    if inv_temp is not None:
        x.mul_(inv_temp.unsqueeze(1))
    d = x.sub_(lse.unsqueeze(1)).exp_().mul_(-g.unsqueeze(1))
    d.scatter_add_(1, labels.unsqueeze(1), g.unsqueeze(1))
    return d.to(logits.dtype)


def _dentropy(logits: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, inv_temp: torch.Tensor | None) -> torch.Tensor:
    """``d(g * entropy) / d logits`` of ``softmax(logits * inv_temp)``, float32: with ``x`` the
    scaled logits and ``log p = x - lse``, ``dH/dx = -p * (log p + H)``; times ``inv_temp``."""
    x = logits.float()
    if inv_temp is not None:
        x = x * inv_temp.unsqueeze(1)
        g = g * inv_temp
    logp = x - lse.unsqueeze(1)
    p = logp.exp()
    ent = -(p * logp).sum(dim=-1, keepdim=True)
    return -(p * (logp + ent)) * g.unsqueeze(1)


def _stats_and_dlogits(logits: torch.Tensor, labels: torch.Tensor, inv_temp: torch.Tensor | None, g: torch.Tensor,
                       with_entropy: bool):
    """``(logp, entropy, d logits)`` of one chunk: :func:`_softmax_stats` and :func:`_dlogits` in
    one function (one compiled graph on CUDA, which keeps the log-normaliser in registers)."""
    lse, logp, ent = _softmax_stats(logits, labels, inv_temp, with_entropy)
    return logp, ent, _dlogits(logits, lse, labels, g, inv_temp)


def _stats_and_dlogits_eager(logits: torch.Tensor, labels: torch.Tensor, inv_temp: torch.Tensor | None,
                             g: torch.Tensor, with_entropy: bool):
    lse, logp, ent = _softmax_stats(logits, labels, inv_temp, with_entropy)
    return logp, ent, _dlogits_eager(logits, lse, labels, g, inv_temp)


class _FusedMath:
    """The chunk math above, compiled once per process on CUDA (``torch.compile``), eager elsewhere.

    A failed compilation (no working Triton, say) falls back to eager for good, with a warning.
    """

    def __init__(self) -> None:
        self.compiled: dict[str, Any] = {}
        self.broken = False

    def get(self, name: str, fn, device: torch.device, enabled: bool):
        if not enabled or device.type != "cuda" or self.broken:
            return fn
        if name not in self.compiled:
            self.compiled[name] = compile_rows_dynamic(fn)  # row count symbolic, vocabulary constant
        return self.compiled[name]

    def call(self, name: str, fn, device: torch.device, enabled: bool, *args, eager=None):
        """``fn(*args)``, compiled when enabled on CUDA; ``eager`` (default ``fn``) runs otherwise."""
        eager = eager or fn
        f = self.get(name, fn, device, enabled)
        if f is fn:
            return eager(*args)
        try:
            return f(*args)
        except Exception:  # compilation is an optimisation: never let it fail a step
            log.warning("torch.compile of the logprob math failed; using eager PyTorch", exc_info=True)
            self.broken = True
            return eager(*args)


_FUSED = _FusedMath()


_MM_OUT_DTYPE: bool | None = None  # whether torch.addmm(..., out_dtype=) works here (recent CUDA builds)


def _add_outer(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc + a.T @ b`` with a float32 ``acc``; half-precision operands stay on tensor cores."""
    global _MM_OUT_DTYPE
    if a.dtype == acc.dtype:
        return acc.addmm_(a.t(), b)
    if a.is_cuda and _MM_OUT_DTYPE is not False:
        try:
            out = torch.addmm(acc, a.t(), b, out_dtype=acc.dtype)
            _MM_OUT_DTYPE = True
            return out
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE = False
    return acc.add_(a.t() @ b)


class _HeadGrads:
    """The LM head's gradients with respect to its input, weight and bias, accumulated chunk by
    chunk from each chunk's gradient with respect to the logits (float32 sums for weight and bias)."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 need_h: bool, need_w: bool, need_b: bool):
        self.acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
        self.h = torch.empty_like(hidden) if need_h else None
        self.w = torch.zeros(weight.shape, dtype=self.acc, device=weight.device) if need_w else None
        self.b = torch.zeros(weight.shape[0], dtype=self.acc, device=weight.device) if need_b and bias is not None else None

    def add(self, dl: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, s: int, e: int) -> None:
        """Rows ``s:e``, whose logits' gradient is ``dl``."""
        if self.h is not None:
            self.h[s:e] = dl @ weight
        if self.w is not None:
            self.w = _add_outer(self.w, dl, hidden[s:e].to(weight.dtype))
        if self.b is not None:
            self.b += dl.sum(0, dtype=self.acc)

    def result(self, weight: torch.Tensor, bias: torch.Tensor | None) -> list[torch.Tensor | None]:
        """``[grad_hidden, grad_weight, grad_bias]`` in the parameters' dtypes (None where not needed)."""
        return [self.h, None if self.w is None else self.w.to(weight.dtype),
                None if self.b is None else self.b.to(bias.dtype)]


class _ChunkedLogprob(torch.autograd.Function):
    """logprob of ``labels`` (and entropy) under ``softmax((hidden @ W.T + b) / T)``, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, inv_temp, chunk_size, with_entropy, fused):
        n = hidden.shape[0]
        f32 = dict(dtype=torch.float32, device=hidden.device)
        logp, lse_all = torch.empty(n, **f32), torch.empty(n, **f32)
        ent = torch.empty(n if with_entropy else 0, **f32)
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            logits = _chunk_logits(hidden[s:e], weight, bias)
            it = None if inv_temp is None else inv_temp[s:e]
            lse, lp, en = _FUSED.call("stats", _softmax_stats, hidden.device, fused, logits, labels[s:e], it,
                                      with_entropy)
            lse_all[s:e] = lse
            logp[s:e] = lp
            if with_entropy:
                ent[s:e] = en
        ctx.save_for_backward(hidden, weight, bias, labels, inv_temp, lse_all)
        ctx.chunk_size = chunk_size
        ctx.fused = fused
        ctx.set_materialize_grads(False)  # an unused output (the entropy, mostly) brings no gradient
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, bias, labels, inv_temp, lse_all = ctx.saved_tensors
        grads = _HeadGrads(hidden, weight, bias, *ctx.needs_input_grad[:3])
        n = hidden.shape[0]
        zero = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, ctx.chunk_size):
            e = min(n, s + ctx.chunk_size)
            it = None if inv_temp is None else inv_temp[s:e]
            logits = _chunk_logits(hidden[s:e], weight, bias)
            g = (grad_logp if grad_logp is not None else zero)[s:e].float()
            if it is not None:
                g = g * it
            dl_ent = None if grad_ent is None else _dentropy(logits, lse_all[s:e], grad_ent[s:e].float(), it)
            dl = _FUSED.call("dlogits", _dlogits, hidden.device, ctx.fused, logits, lse_all[s:e], labels[s:e], g, it,
                             eager=_dlogits_eager)
            del logits
            if dl_ent is not None:
                dl = (dl.float() + dl_ent).to(dl.dtype)
            grads.add(dl, hidden, weight, s, e)
        return (*grads.result(weight, bias), None, None, None, None, None)


class _HeadGradAhead(torch.autograd.Function):
    """``sum_t g_t * logprob_t`` (a scalar) for per-token weights ``g`` known before the forward
    pass, with its gradient computed *during* the forward pass, chunk by chunk, while each
    chunk's logits are at hand; the backward pass only scales it. Same logits, softmax math and
    accumulation order as :class:`_ChunkedLogprob`'s backward, without projecting every chunk
    a second time. Also returns the logprobs and entropies (no gradient)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, inv_temp, g, chunk_size, with_entropy, fused):
        n = hidden.shape[0]
        f32 = dict(dtype=torch.float32, device=hidden.device)
        logp = torch.empty(n, **f32)
        ent = torch.empty(n if with_entropy else 0, **f32)
        head = _HeadGrads(hidden, weight, bias, *ctx.needs_input_grad[:3])
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            it = None if inv_temp is None else inv_temp[s:e]
            gc = g[s:e].float()
            if it is not None:
                gc = gc * it
            logits = _chunk_logits(hidden[s:e], weight, bias)
            lp, en, dl = _FUSED.call("stats_dlogits", _stats_and_dlogits, hidden.device, fused, logits,
                                        labels[s:e], it, gc, with_entropy, eager=_stats_and_dlogits_eager)
            del logits
            logp[s:e] = lp
            if with_entropy:
                ent[s:e] = en
            head.add(dl, hidden, weight, s, e)
        grads = head.result(weight, bias)
        del head  # the float32 accumulators, before the decoder's backward pass needs the memory
        ctx.present = [t is not None for t in grads]
        ctx.save_for_backward(*(t for t in grads if t is not None))
        ctx.mark_non_differentiable(logp, ent)
        return (g.float() * logp).sum(), logp, ent

    @staticmethod
    def backward(ctx, grad_value, grad_logp, grad_ent):
        saved = iter(ctx.saved_tensors)
        grads = [next(saved) if present else None for present in ctx.present]
        # grad_value is 1 when the value is the root of the backward pass (the worker's case);
        # scaling in the gradient's dtype costs one pass over tensors much smaller than the logits
        grads = [None if t is None else t * grad_value.to(t.dtype) for t in grads]
        return (*grads, None, None, None, None, None, None)


def head_value_and_grad_ahead(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    inv_temperature: torch.Tensor | None,
    grad_logp: torch.Tensor,
    chunk_size: int,
    with_entropy: bool = True,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sum(grad_logp * logprob), logprob, entropy)`` for the same inputs as :func:`chunked_logprobs`.

    The scalar's backward pass gives ``hidden``, ``weight`` and ``bias`` exactly the gradients that
    :func:`chunked_logprobs` would give them for an upstream gradient ``grad_logp`` on its
    logprobs, but they are computed in the forward pass: each chunk of logits is projected once,
    not twice. Use it when the loss's gradient with respect to every logprob is known before the
    forward pass (one on-policy optimizer step with a ratio-only loss: see
    :func:`rlcli.train.step_loss.head_grad_ahead`).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if grad_logp.shape != labels.shape:
        raise ValueError(f"grad_logp must have the labels' shape {tuple(labels.shape)}, got {tuple(grad_logp.shape)}")
    it = inv_temperature.float() if inv_temperature is not None else None
    return _HeadGradAhead.apply(hidden, weight, bias, labels, it, grad_logp, chunk_size, with_entropy, fused)


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    inv_temperature: torch.Tensor | None,
    chunk_size: int,
    with_entropy: bool = True,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``(logprob of label, entropy)`` of ``softmax((hidden @ W.T + b) * inv_temperature)``.

    ``hidden``: ``[N, h]``; ``labels``, ``inv_temperature``: ``[N]`` (None: temperature 1).
    float32 softmax math, at most ``chunk_size`` rows of logits at a time, also in backward (which
    recomputes each chunk from the saved log-normaliser). Both carry gradients (the entropy's for
    an entropy bonus, ``train_worker.entropy_coef``); with ``with_entropy=False`` the entropy is
    skipped (an empty tensor is returned). ``fused``: on CUDA, run the
    per-chunk softmax math through ``torch.compile`` (a couple of fused passes over the logits
    instead of a dozen eager ones).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    it = inv_temperature.float() if inv_temperature is not None else None
    return _ChunkedLogprob.apply(hidden, weight, bias, labels, it, chunk_size, with_entropy, fused)


class PolicyModel(nn.Module):
    """Wraps an HF causal LM so that one FSDP2 root forward returns label logprobs and entropies."""

    def __init__(self, lm: nn.Module, chunk_size: int, fused: bool = True):
        super().__init__()
        self.lm = lm
        self.chunk_size = chunk_size
        self.fused = fused

    def forward(self, input_ids, position_ids, label_index, labels, inv_temperature, with_entropy: bool = True,
                attn_rows=None, attn_owner=None, grad_logp=None):
        """``(logprobs, entropies)`` of the labels; with ``grad_logp`` (per-label weights known
        before the pass), ``(sum(grad_logp * logprobs), logprobs, entropies)``, the head's
        gradient computed during the pass (:func:`head_value_and_grad_ahead`)."""
        decoder = self.lm.get_decoder()
        # the shared layout's attention rows travel to the attention function as keyword arguments
        shared = {} if attn_rows is None else {"attn_rows": attn_rows, "attn_owner": attn_owner}
        hidden = decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False, **shared).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, label_index)
        head = self.lm.get_output_embeddings()
        if grad_logp is not None:
            return head_value_and_grad_ahead(hidden, head.weight, head.bias, labels, inv_temperature, grad_logp,
                                             self.chunk_size, with_entropy, self.fused)
        return chunked_logprobs(hidden, head.weight, head.bias, labels, inv_temperature, self.chunk_size,
                                with_entropy, self.fused)

