"""The train worker: an HF causal LM under FSDP2, trained with a registered policy loss.

One ``TrainWorker`` per rank (a single process is a one-rank group: FSDP2 is always used).
:meth:`TrainWorker.train_step` runs one RL step on this rank's sequences::

    split into optimizer_steps mini-batches (contiguous, token-balanced)
    pack every mini-batch (<= pack_max_length tokens per micro-batch)
    old logprobs: a no-grad pass when optimizer_steps > 1 or when rollout IS may drop tokens;
                  otherwise the detached current logprobs (the ratio is exactly 1 at the first
                  and only update)
    rollout IS (train_worker.rollout_is): weights / dropped tokens from old - rollout logprobs
    reference logprobs (train_worker.kl.coef > 0): a no-grad pass of the frozen initial policy
    for each mini-batch: forward/backward every micro-batch, loss weighted by 1 / (kept tokens
                  of the mini-batch on all ranks) x IS weight, plus coef x KL(policy || ref) with
                  the same token weights; clip; optimizer step unless the loss or the grad norm
                  is not finite; LR scheduler step

With ``kl.coef == 0`` and ``rollout_is`` null none of the optional passes runs.

Log-probs and entropies are computed from ``logits / temperature`` (per sequence) by a fused,
chunked ``lm_head`` + ``log_softmax`` (:func:`chunked_logprobs`): only label positions are
projected, ``logprob_chunk_size`` rows at a time in float32, and the backward pass recomputes
each chunk instead of keeping ``[tokens, vocab]`` logits alive. When every token's loss gradient
is known before the forward pass (``head_grad_in_forward``; see :meth:`TrainWorker._head_grad_ahead`)
the head's gradient is computed during the forward pass instead (:func:`head_value_and_grad_ahead`),
so each chunk is projected once.

Ranks: every rank runs the same number of micro-batches per mini-batch (short ranks run empty
ones), token/sequence counts and metrics are all-reduced, and the loss is scaled by the world
size because FSDP averages gradients while the loss is already normalised globally. On a single
rank, micro-batches of a mini-batch accumulate gradients without FSDP's per-micro-batch
reduce-scatter/re-gather copies (free there; see ``_accumulating``).

Dropout: forwards with gradients run in ``train()`` mode, no-grad forwards in ``eval()`` mode;
they agree for the dropout-free decoders RL fine-tunes (Qwen, Llama, ...).

Reference model (KL penalty): the initial policy, read again from ``model_dir`` on the first step
that needs it (a worker that only evaluates never loads it) directly in the FSDP compute dtype,
frozen and sharded like the policy; with ``kl.ref_offload`` on CUDA its shards stay in CPU memory
and each layer is brought to the GPU only for its forward. It is never saved in checkpoints: a
resumed run reads the same weights from the same directory.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as adamw_functional

from rlcli.algo.kl import kl_penalty
from rlcli.algo.loss import aggregation_weights
from rlcli.algo.mismatch import (
    RolloutCorrection,
    can_reject,
    finalize_metrics,
    masks,
    rollout_correction,
    truncates,
    vetoes,
)
from rlcli.compiling import compile_rows_dynamic
from rlcli.config import RolloutISConfig
from rlcli.dist import barrier, device_mesh, group_mesh, init_distributed, local_device
from rlcli.fsutil import publish_dir
from rlcli.models import resolve_dtype
from rlcli.train import checkpoint as ckpt
from rlcli.train.attention import use_shared_prompt_attention
from rlcli.train.data import (
    LayoutCost,
    LazyList,
    MicroBatch,
    TrainSequence,
    build_micro_batch,
    choose_layout,
    empty_micro_batch,
    pack_balanced,
    pack_shared,
    split_minibatches,
)
from rlcli.train.lr import build_scheduler

log = logging.getLogger(__name__)

#: ``rollout_is`` when the recipe sets none: the ``mismatch/*`` metrics, no weighting, nothing dropped.
METRICS_ONLY = RolloutISConfig()

if TYPE_CHECKING:
    from rlcli.algo.loss import PolicyLoss
    from rlcli.config import ModelConfig, TrainWorkerConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


# ------------------------------------------------------------------ chunked logprob/entropy
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


@functools.cache
def _inductor_with_budget(budget: float):
    """Inductor, partitioning forward and backward under ``activation_memory_budget``.

    The budget is a global functorch setting that compiled graphs are not keyed on, so a plain
    ``torch.compile`` would silently reuse a graph partitioned under another budget (a second
    TrainWorker in the process, say). One backend object per budget keeps them apart: Dynamo
    recompiles when the backend differs.
    """
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        with functorch_config.patch(activation_memory_budget=budget):
            return compile_fx(gm, example_inputs)

    return backend


def _layer_compile_kwargs(budget: float) -> dict[str, Any]:
    return {} if budget >= 1 else {"backend": _inductor_with_budget(float(budget))}


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
    ``TrainWorker._head_grad_ahead``).
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


def clip_grad_norm_local(grads: list[torch.Tensor], max_norm: float, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Clip ``grads`` in place to a global L2 norm of at most ``max_norm``; returns the norm before
    clipping as a float32 device scalar (``nan``/``inf`` when a gradient is not finite), without
    waiting for the device. Collective over ``group`` (None: one rank).

    The same result as ``torch.nn.utils.clip_grad_norm_`` on FSDP's DTensor gradients, computed on
    the local shards: the squared norms of sharded gradients are summed over the ranks, those of
    replicated ones counted once. Dispatching the norm through DTensor took 0.14 s of host time
    per optimizer step for a 24-layer model (H200 host, under torch.profiler), with the GPU idle.
    """
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    local = [_local(g) for g in grads]
    sharded, replicated = [], []  # the norms, split by placement (no host-to-device copy of a mask)
    for g, n in zip(grads, torch._foreach_norm(local)):
        (sharded if isinstance(g, DTensor) and any(pl.is_shard() for pl in g.placements) else replicated).append(n)

    def sq_sum(ns: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(ns).float().square().sum() if ns else torch.zeros((), device=local[0].device)

    total = sq_sum(sharded)
    if group is not None and sharded:
        dist.all_reduce(total, group=group)
    norm = (total + sq_sum(replicated)).sqrt()
    if math.isfinite(max_norm):
        # float32 arithmetic, as torch's clip_grad_norm_ does it; a factor of exactly 1 changes nothing
        torch._foreach_mul_(local, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (no dispatch, no autograd), or ``t`` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def adamw_step_local(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> bool:
    """``optimizer.step()`` of a fused ``torch.optim.AdamW`` applied to the local shards of its
    DTensor parameters, gradients and moments, skipped on the device when ``found_inf`` (a float32
    device scalar) is nonzero. Returns False, doing nothing, when it cannot stand in for
    ``optimizer.step()``: moments not created yet (the first step creates them the usual way), a
    step count that is not a device scalar next to its parameter, or AdamW options the fused
    kernel does not take (amsgrad, capturable, differentiable).

    AdamW is elementwise, so the update of each shard is the update of the whole, bit for bit,
    and the moments stay the DTensors that checkpoints save. What it avoids: DTensor dispatch of
    the fused kernel over every parameter (host time, with the GPU idle), and the host sync that
    deciding "skip this step" on the host needs (the fused kernel's ``found_inf`` undoes the step
    count and leaves parameters and moments as they were).
    """
    if not isinstance(optimizer, torch.optim.AdamW):
        return False
    plans = []
    for group in optimizer.param_groups:
        if not group.get("fused") or group.get("amsgrad") or group.get("capturable") or group.get("differentiable"):
            return False
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            st = optimizer.state.get(p)
            if not st or "exp_avg" not in st:
                return False
            local = _local(p)
            step = st["step"]
            if isinstance(step, DTensor) or step.device != local.device:
                return False
            params.append(local)
            grads.append(_local(p.grad))
            exp_avgs.append(_local(st["exp_avg"]))
            exp_avg_sqs.append(_local(st["exp_avg_sq"]))
            steps.append(step)
        plans.append((group, params, grads, exp_avgs, exp_avg_sqs, steps))
    for group, params, grads, exp_avgs, exp_avg_sqs, steps in plans:
        if params:
            beta1, beta2 = group["betas"]
            adamw_functional(
                params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=False, capturable=False,
                differentiable=False, fused=True, grad_scale=None, found_inf=found_inf, has_complex=False,
                amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                eps=group["eps"], maximize=group["maximize"],
            )
    return True


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


# ----------------------------------------------------------------------------- metrics
class _Metrics:
    """Token-weighted means and extremes, kept on the device (no host sync per micro-batch);
    reduced over ranks and read back once per step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.maxes: dict[str, torch.Tensor] = {}
        self.mins: dict[str, torch.Tensor] = {}

    def _zero(self) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float64, device=self.device)

    def add_sum(self, name: str, total: torch.Tensor, weight: torch.Tensor | float) -> None:
        """Add ``total`` (a sum over ``weight`` tokens) to the mean metric ``name``."""
        self.sums[name] = self.sums.get(name, self._zero()) + total.detach().double()
        self.weights[name] = self.weights.get(name, self._zero()) + weight

    def add_extreme(self, name: str, value: torch.Tensor) -> None:
        """Fold ``value`` into the running maximum (``*_max``) or minimum (``*_min``) ``name``."""
        v = value.detach().double()
        if name.endswith("_max"):
            self.maxes[name] = torch.maximum(self.maxes[name], v) if name in self.maxes else v
        elif name.endswith("_min"):
            self.mins[name] = torch.minimum(self.mins[name], v) if name in self.mins else v
        else:
            raise ValueError(f"extreme metric names end with _max or _min, got {name!r}")

    def add_loss_metrics(self, metrics: dict[str, torch.Tensor], weight: int | torch.Tensor) -> None:
        """A loss's metrics: extremes by name, everything else a mean over ``weight`` tokens."""
        for k, v in metrics.items():
            if k.endswith(("_max", "_min")):
                self.add_extreme(k, v)
            else:
                self.add_sum(k, v.detach().double() * weight, weight)

    def reduce(self, world_size: int, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        names_mean, names_max, names_min = sorted(self.sums), sorted(self.maxes), sorted(self.mins)
        z = self._zero()
        sums = torch.stack([self.sums[k] for k in names_mean] + [self.weights[k] for k in names_mean] + [z])
        ext = torch.stack([self.maxes[k] for k in names_max] + [-self.mins[k] for k in names_min] + [z])
        if world_size > 1:
            # Every rank added the same names (same loss, same code path), so the layouts agree.
            dist.all_reduce(sums, group=group)
            dist.all_reduce(ext, op=dist.ReduceOp.MAX, group=group)
        s, e = sums.tolist(), ext.tolist()
        n = len(names_mean)
        out = {k: (s[i] / s[n + i] if s[n + i] > 0 else 0.0) for i, k in enumerate(names_mean)}
        out.update({k: e[i] for i, k in enumerate(names_max)})
        out.update({k: -e[len(names_max) + i] for i, k in enumerate(names_min)})
        return {k: (v if math.isfinite(v) else 0.0) if k in self.maxes or k in self.mins else v
                for k, v in out.items()}


# ------------------------------------------------------------------------------ worker
class TrainWorker:
    """FSDP2 policy trainer for one rank: train steps, logprobs, weight export, checkpoints.

    ``model_dir``: an HF causal-LM directory, loaded with float32 master weights. ``dtype``: the
    run dtype (FSDP param dtype when ``fsdp.param_dtype`` is auto; default from
    ``model_cfg.dtype``). ``total_steps``: RL steps of the run; the LR schedule spans
    ``total_steps × optimizer_steps`` optimizer steps. Every public method is collective.

    ``process_group``: the ranks this worker trains with (default: every rank of the job). FSDP2
    shards over exactly these ranks and every reduction, barrier and "rank 0 writes" decision of
    training, weight export and HF export stays inside the group, so other ranks (e.g. the
    rollout ranks of a disaggregated run) are free meanwhile. Checkpoints
    (:meth:`save_checkpoint`, :meth:`load_checkpoint`) remain collective over the whole job:
    ranks outside the group join them with a stand-in module of their own (as the rollout ranks of
    ``rlcli.runner.disaggregated`` do).
    """

    def __init__(
        self,
        model_dir: str | Path,
        model_cfg: ModelConfig,
        cfg: TrainWorkerConfig,
        policy_loss: PolicyLoss,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        seed: int = 0,
        total_steps: int = 1,
        process_group: dist.ProcessGroup | None = None,
    ):
        from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.model_cfg = model_cfg
        self.policy_loss = policy_loss
        self.device = torch.device(device)
        self.rank, self.world_size = init_distributed(self.device)
        self.group = process_group
        if process_group is not None:
            self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
            if self.rank < 0:
                raise ValueError("this process is not a member of the TrainWorker's process_group")
        self.device = local_device(self.device)
        self.mesh = device_mesh(self.device) if process_group is None else group_mesh(process_group, self.device)
        self.dtype = dtype if dtype is not None else resolve_dtype(getattr(model_cfg, "dtype", "auto"), self.device)
        self.total_optimizer_steps = max(1, total_steps) * cfg.optimizer_steps
        torch.manual_seed(seed)  # the torch generator drives any dropout; saved/restored by checkpoints

        self.model_dir = Path(model_dir)
        self.ref_model: PolicyModel | None = None  # frozen initial policy, built on first use (KL)
        self.hf_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.hf_model.config.use_cache = False
        if cfg.share_prompts:
            use_shared_prompt_attention(self.hf_model)
        self.pad_id = self.hf_model.config.pad_token_id or 0
        self.layout_cost = LayoutCost.from_config(self.hf_model.config)
        self.tied = bool(getattr(self.hf_model.config, "tie_word_embeddings", False))
        if cfg.gradient_checkpointing:
            kwargs = {"use_reentrant": False}  # the reentrant variant does not compose with FSDP2
            if hasattr(self.hf_model, "activation_checkpointing_enable"):  # transformers >= 5.x
                self.hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                self.hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        self.model = PolicyModel(self.hf_model, cfg.logprob_chunk_size, cfg.fused_logprob)
        self._shard(self.model, cpu_offload=cfg.fsdp.cpu_offload)
        self.model.train()

        opt = cfg.optimizer
        params = [p for p in self.model.parameters() if p.requires_grad]
        # The fused kernel (CPU and CUDA, DTensor-aware) is the fastest here: ~30% less step time on CPU.
        self.optimizer = torch.optim.AdamW(
            params, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay, fused=True
        )
        self.scheduler = build_scheduler(self.optimizer, cfg.lr_scheduler, self.total_optimizer_steps)

    # -------------------------------------------------------------------------- setup
    @property
    def param_dtype(self) -> torch.dtype:
        """The FSDP compute dtype of the decoder (the run dtype unless ``fsdp.param_dtype`` is set)."""
        fs = self.cfg.fsdp
        return self.dtype if fs.param_dtype == "auto" else _DTYPES[fs.param_dtype]

    def _shard(self, model: PolicyModel, cpu_offload: bool) -> None:
        """``fully_shard`` every decoder layer of ``model.lm``, then the root (policy and reference alike)."""
        fs = self.cfg.fsdp
        param_dtype = self.param_dtype
        reduce_dtype = _DTYPES[fs.reduce_dtype]
        offload_to_cpu = cpu_offload and self.device.type == "cuda"
        offload: OffloadPolicy = CPUOffloadPolicy() if offload_to_cpu else OffloadPolicy()
        layer_mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        # The root's inputs are ids and float32 temperatures: never cast them to the param dtype.
        root_mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
        if not offload_to_cpu:
            model.lm.to(self.device)
        for layer in self._decoder_layers(model.lm):
            if fs.torch_compile:
                layer.compile(**_layer_compile_kwargs(fs.activation_memory_budget))
            fully_shard(layer, mesh=self.mesh, mp_policy=layer_mp, offload_policy=offload,
                        reshard_after_forward=fs.reshard_after_forward)
        fully_shard(model, mesh=self.mesh, mp_policy=root_mp, offload_policy=offload)

    @staticmethod
    def _decoder_layers(lm: nn.Module) -> list[nn.Module]:
        layers = getattr(lm.get_decoder(), "layers", None)
        if layers is None:
            raise ValueError(f"{type(lm).__name__}: cannot find the decoder layers (expected .layers)")
        return list(layers)

    def _reference(self) -> PolicyModel:
        """The frozen reference policy (see the module docstring), built on the first call. Collective."""
        if self.ref_model is None:
            from transformers import AutoModelForCausalLM

            # Loading must not advance the RNG streams that checkpoints save and restore: a resumed
            # run builds the reference at a different step than the uninterrupted one.
            cuda = [self.device.index or 0] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda):
                lm = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=self.param_dtype)
            lm.config.use_cache = False
            if self.cfg.share_prompts:
                use_shared_prompt_attention(lm)
            lm.requires_grad_(False)
            ref = PolicyModel(lm, self.cfg.logprob_chunk_size, self.cfg.fused_logprob)
            self._shard(ref, cpu_offload=self.cfg.kl.ref_offload)
            ref.eval()
            self.ref_model = ref
        return self.ref_model

    # ------------------------------------------------------------------------ batches
    def _micro_batches(self, seqs: list[TrainSequence], groups: list[list[int]]) -> list[LazyList[MicroBatch]]:
        """Pack each index group; every rank gets the same number of micro-batches per group.

        A micro-batch's tensors are built (and copied to the device) when it is first used, so
        that building the next one can overlap the device's work on the previous one instead of
        holding up the first forward (six 32k-token packs built up front: 23 ms of host time under
        torch.profiler on the H200, the GPU idle for 17 ms of it)."""
        packer = pack_shared if self.cfg.share_prompts else pack_balanced
        packs = [packer(seqs, self.cfg.pack_max_length, g) for g in groups]
        counts = [len(p) for p in packs]
        if self.world_size > 1:
            t = torch.tensor(counts, dtype=torch.long, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            counts = t.tolist()
        out = []
        for group_packs, n in zip(packs, counts):
            makers = [functools.partial(self._build_micro_batch, seqs, p) for p in group_packs]
            makers += [functools.partial(self._build_micro_batch, seqs, None)] * (n - len(makers))
            out.append(LazyList(makers))
        return out

    def _build_micro_batch(self, seqs: list[TrainSequence], pack) -> MicroBatch:
        mb = (build_micro_batch(seqs, pack, self._layout(pack.lengths), self.pad_id) if pack is not None
              else empty_micro_batch(self.pad_id))
        return mb.to(self.device)

    def _layout(self, lengths: list[int]):
        if self.cfg.share_prompts:
            return "shared"
        forced = getattr(self.cfg, "pack_layout", "auto")
        if forced in ("packed", "padded"):
            return forced
        return choose_layout(lengths, self.cfg.pack_max_length, self.layout_cost)

    def _forward(self, mb: MicroBatch, with_entropy: bool = True, model: PolicyModel | None = None,
                 grad_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        inv_t = None if mb.unit_temperature else mb.inv_temperature
        return (model or self.model)(mb.input_ids, mb.position_ids, mb.label_index, mb.labels, inv_t, with_entropy,
                                     mb.attn_rows, mb.attn_owner, grad_logp)

    def _all_sum(self, values: list[float]) -> list[float]:
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    @torch.no_grad()
    def _old_logprobs(self, batches: list[list[MicroBatch]], m: _Metrics) -> list[list[torch.Tensor]]:
        """Log-probs of every micro-batch under the current weights (no grad); records the entropy."""
        old = []
        self.model.eval()
        try:
            for mbs in batches:
                row = []
                for mb in mbs:
                    logp, ent = self._forward(mb)
                    row.append(logp)
                    m.add_sum("entropy", ent.sum(), mb.num_labels)
                old.append(row)
        finally:
            self.model.reshard()
            self.model.train()
        return old

    @torch.no_grad()
    def _reference_logprobs(self, batches: list[list[MicroBatch]]) -> list[list[torch.Tensor]]:
        """Log-probs of every micro-batch under the frozen reference policy. Collective."""
        ref = self._reference()
        try:
            return [[self._forward(mb, with_entropy=False, model=ref)[0] for mb in mbs] for mbs in batches]
        finally:
            ref.reshard()

    def _rollout_correction(self, mb: MicroBatch, old_logp: torch.Tensor, m: _Metrics) -> RolloutCorrection:
        c = rollout_correction(old_logp, mb.rollout_logprobs, mb.has_rollout_logprobs, mb.seq_local,
                               len(mb.seq_indices), self.cfg.rollout_is or METRICS_ONLY)
        for name, (total, count) in c.sums.items():
            m.add_sum(name, total, count)
        for name, value in {**c.maxes, **c.mins}.items():
            m.add_extreme(name, value)
        return c

    def _kept_counts(self, batches: list[list[MicroBatch]],
                     corr: list[list[RolloutCorrection]]) -> tuple[list[float], list[float]]:
        """Per mini-batch: tokens and sequences (with at least one token) that rollout IS kept; one host sync."""
        rows = []
        for mbs, cs in zip(batches, corr):
            toks = torch.zeros((), dtype=torch.float64, device=self.device)
            nseq = torch.zeros((), dtype=torch.float64, device=self.device)
            for mb, c in zip(mbs, cs):
                keep = c.keep.double()
                toks = toks + keep.sum()
                per_seq = torch.zeros(len(mb.seq_indices), dtype=torch.float64, device=self.device)
                nseq = nseq + (per_seq.index_add_(0, mb.seq_local, keep) > 0).double().sum()
            rows.append(torch.stack([toks, nseq]))
        counts = torch.stack(rows).tolist() if rows else []
        return [t for t, _ in counts], [n for _, n in counts]

    def _head_grad_ahead(self) -> bool:
        """Whether every token's loss gradient is known before the forward pass, so that the LM
        head's gradient can be computed while its logits are at hand (``head_grad_in_forward``).

        It is when the update is the batch's first and only one (the old logprobs are the
        current ones, detached: the ratio is exactly 1), the loss depends on the logprobs only
        through ``logp - old_logp`` (:attr:`PolicyLoss.ratio_only`), and nothing else in the
        loss reads the logprobs' values: no KL penalty, no entropy bonus, and rollout IS neither
        weights nor drops tokens (a metrics-only ``rollout_is: {}`` is fine)."""
        cfg, is_cfg = self.cfg, self.cfg.rollout_is
        if not cfg.head_grad_in_forward or cfg.optimizer_steps != 1 or cfg.kl.coef > 0 or cfg.entropy_coef > 0:
            return False
        if is_cfg is not None and (truncates(is_cfg) or masks(is_cfg) or vetoes(is_cfg)):
            return False
        return bool(getattr(self.policy_loss, "ratio_only", False))

    def _on_policy_grad(self, mb: MicroBatch, num_tokens: int, num_seqs: int) -> torch.Tensor:
        """d(loss of ``mb``, scaled as its backward pass would be)/d logprob, per label, at ratio 1.

        The policy loss is evaluated at ``logp = old_logp = 0``: for a ratio-only loss every
        intermediate equals its value at the real logprobs (``logp - old_logp`` is exactly 0 in
        both), so the gradient is the one the ordinary backward pass would bring to the head."""
        z = torch.zeros(mb.labels.shape, dtype=torch.float32, device=self.device, requires_grad=True)
        mask = torch.ones_like(mb.labels, dtype=torch.bool)
        with torch.enable_grad():
            tok_loss, _ = self.policy_loss.per_token_loss(z, z.detach(), mb.advantages, mask, mb.seq_local)
            w = aggregation_weights(self.policy_loss.loss_agg, mask, mb.seq_local, num_tokens, num_seqs,
                                    num_local_seqs=len(mb.seq_indices))
            loss = (tok_loss * w).sum()
            (g,) = torch.autograd.grad(loss * self.world_size if self.world_size > 1 else loss, z, allow_unused=True)
        return torch.zeros_like(z) if g is None else g.detach()

    # -------------------------------------------------------------------------- train
    def train_step(self, seqs: list[TrainSequence]) -> dict[str, float]:
        """One RL step on this rank's sequences (collective). Returns ``train/*`` and ``mismatch/*``
        metrics (global); the engine-trainer mismatch is measured whether or not ``rollout_is``
        corrects for it."""
        t0 = time.perf_counter()
        k = self.cfg.optimizer_steps
        is_cfg = self.cfg.rollout_is
        kl_cfg = self.cfg.kl
        groups = split_minibatches([s.num_tokens for s in seqs], k)
        # Sequences without a trained token change nothing: leave them out of the forwards.
        groups = [[i for i in g if seqs[i].num_valid > 0] for g in groups]
        with torch.profiler.record_function("rlcli/train/pack"):  # a named range in profiler traces
            batches = self._micro_batches(seqs, groups)
        m = _Metrics(self.device)

        # Old logprobs are needed up front when the policy moves within the step, and when rollout
        # IS may drop tokens (the loss normaliser counts kept tokens only). Otherwise the first and
        # only update's old logprobs are its own detached logprobs, and IS weights come from them.
        old: list[list[torch.Tensor]] | None = None
        corr: list[list[RolloutCorrection]] | None = None
        if k > 1 or can_reject(is_cfg):
            old = self._old_logprobs(batches, m)
            if is_cfg is not None:
                corr = [[self._rollout_correction(mb, lp, m) for mb, lp in zip(mbs, row)]
                        for mbs, row in zip(batches, old)]
        ref = self._reference_logprobs(batches) if kl_cfg.coef > 0 else None

        if corr is not None and can_reject(is_cfg):
            tok_counts, seq_counts = self._kept_counts(batches, corr)
        else:
            # what the micro-batches will hold, known without building them (groups keep only
            # sequences with a trained token)
            tok_counts = [float(sum(seqs[i].num_valid for i in g)) for g in groups]
            seq_counts = [float(len(g)) for g in groups]
        counts = self._all_sum(tok_counts + seq_counts)
        num_tokens, num_seqs = [int(c) for c in counts[:k]], [int(c) for c in counts[k:]]

        loss_agg = self.policy_loss.loss_agg
        ahead = self._head_grad_ahead()
        losses: list[float] = []
        grad_norms: list[float] = []
        lrs: list[float] = []
        skipped = 0
        for j, mbs in enumerate(batches):
            local_loss = torch.zeros((), dtype=torch.float32, device=self.device)
            for mi, mb in enumerate(mbs):
                self._accumulating(mi < len(mbs) - 1)
                if ahead:  # the head's gradient is computed in the forward pass; logp, ent carry none
                    head_value, logp, ent = self._forward(
                        mb, grad_logp=self._on_policy_grad(mb, num_tokens[j], num_seqs[j]))
                else:  # the entropy comes from the old pass when there is one, unless the loss needs it
                    logp, ent = self._forward(mb, with_entropy=old is None or self.cfg.entropy_coef > 0)
                # k == 1: the weights have not moved since any old pass, so the ratio is exactly 1.
                old_logp = old[j][mi] if k > 1 else logp.detach()
                c = corr[j][mi] if corr is not None else self._rollout_correction(mb, old_logp, m)
                if c is not None and c.keep is not None:
                    mask, n_kept = c.keep, c.keep.sum()
                else:
                    mask, n_kept = torch.ones_like(mb.labels, dtype=torch.bool), mb.num_labels
                # Ahead, the loss is evaluated here again, at the real logprobs (its gradient came from
                # the evaluation at 0): its value and metrics are the reported ones, and a non-finite
                # logprob still makes it non-finite and skips the update, as on the ordinary path.
                tok_loss, metrics = self.policy_loss.per_token_loss(logp, old_logp, mb.advantages, mask, mb.seq_local)
                w = aggregation_weights(loss_agg, mask, mb.seq_local, num_tokens[j], num_seqs[j],
                                        num_local_seqs=len(mb.seq_indices))
                loss = (tok_loss * (w * c.weight if c is not None and c.weight is not None else w)).sum()
                if self.cfg.entropy_coef > 0:  # the bonus, weighted like the policy term (masked tokens: 0)
                    loss = loss - self.cfg.entropy_coef * (ent * w).sum()
                if ref is not None:
                    kl = torch.where(mask, kl_penalty(logp, ref[j][mi], kl_cfg.type), 0.0)
                    loss = loss + kl_cfg.coef * (kl * w).sum()
                    m.add_sum("kl_ref", kl.detach().sum(), n_kept)
                # The weights already normalise by the global count, but FSDP averages gradients over
                # ranks: scale by the world size so the update is the gradient of the global loss.
                if ahead:  # its gradient is that of the scaled loss (computed by _on_policy_grad)
                    head_value.backward()
                else:
                    (loss * self.world_size if self.world_size > 1 else loss).backward()
                local_loss += loss.detach()
                # Every rank adds the same metric names (weight 0 when empty): they are reduced together.
                m.add_loss_metrics(metrics, n_kept)
                if old is None:
                    m.add_sum("entropy", ent.sum(), mb.num_labels)
                has = mb.has_rollout_logprobs
                diff = torch.where(has, (old_logp.detach() - mb.rollout_logprobs).abs(), 0.0)
                m.add_sum("rollout_logprob_diff", diff.sum(), has.sum())
            with torch.profiler.record_function("rlcli/train/optimizer"):
                loss_t = local_loss.double()
                if self.world_size > 1:
                    dist.all_reduce(loss_t, group=self.group)
                stats = torch.stack([loss_t, self._clip_grad_norm().to(self.device, torch.float64)])  # (loss, grad norm), on the device
                lrs.append(self.optimizer.param_groups[0]["lr"])
                if num_tokens[j] == 0:
                    # Nothing to learn from (all ranks agree): no update; the schedule still advances.
                    losses.append(0.0)
                    grad_norms.append(0.0)
                else:
                    # A non-finite loss or gradient skips the update. Once AdamW's moments exist the
                    # step is queued right behind the backward pass and skipped on the device, and
                    # the host reads the loss and norm afterwards; the first step decides on the host.
                    found_inf = (~torch.isfinite(stats).all()).float()
                    queued = adamw_step_local(self.optimizer, found_inf)
                    step_loss, grad_norm = stats.tolist()
                    if math.isfinite(step_loss) and math.isfinite(grad_norm):
                        if not queued:
                            self.optimizer.step()
                        losses.append(step_loss)
                        grad_norms.append(grad_norm)
                    else:
                        skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
            with warnings.catch_warnings():
                # A skipped first update would make torch warn that the scheduler stepped first.
                warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
                self.scheduler.step()

        red = m.reduce(self.world_size, self.group)
        out = finalize_metrics({(name if "/" in name else f"train/{name}"): value for name, value in red.items()})
        out.setdefault("train/entropy", 0.0)
        out.setdefault("train/rollout_logprob_diff", 0.0)
        for name in ("clipfrac", "kl_k3"):
            out.setdefault(f"train/{name}", 0.0)
        for name in ("ratio_max", "ratio_min"):
            out.setdefault(f"train/{name}", 1.0)
        out.update({
            "train/loss": sum(losses) / len(losses) if losses else float("nan"),
            "train/grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
            "train/lr": lrs[-1],
            "train/tokens": float(sum(num_tokens)),
            "train/sequences": float(sum(num_seqs)),
            "train/skipped_steps": float(skipped),
            "train/micro_batches": float(sum(len(b) for b in batches)),
            "train/step_time_s": time.perf_counter() - t0,
        })
        return out

    def _accumulating(self, more_to_come: bool) -> None:
        """Gradient accumulation across a mini-batch's micro-batches, on a single rank only.

        Alone, FSDP's per-micro-batch gradient reduce-scatter and parameter re-gather are pure
        copies; skipping them until the last micro-batch costs no memory (sharded == unsharded)
        and saves thousands of small kernels per step. With several ranks the default (sync every
        micro-batch) is kept: accumulating unsharded gradients would cost a full gradient copy.
        """
        if self.world_size == 1:
            self.model.set_requires_gradient_sync(not more_to_come)
            self.model.set_reshard_after_backward(not more_to_come)

    def _clip_grad_norm(self) -> torch.Tensor:
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm is not None else math.inf
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        group = (self.group or dist.group.WORLD) if self.world_size > 1 else None
        return clip_grad_norm_local(grads, max_norm, group)

    # ----------------------------------------------------------------------- logprobs
    @torch.no_grad()
    def compute_logprobs(self, seqs: list[TrainSequence]) -> list[list[float]]:
        """Logprob (at each sequence's temperature) of every response token, ignoring ``response_mask``.

        Collective: every rank must call it (with its own sequences, possibly none).
        """
        full = [s.with_full_mask() for s in seqs]
        (mbs,) = self._micro_batches(full, [list(range(len(full)))])
        out: list[list[float]] = [[] for _ in seqs]
        self.model.eval()
        try:
            results = [self._forward(mb, with_entropy=False)[0] for mb in mbs]
        finally:
            self.model.reshard()
            self.model.train()
        values = torch.cat(results).float().cpu().tolist() if results else []  # one device-to-host copy
        start = 0
        for mb in mbs:
            for c, i in zip(mb.label_counts, mb.seq_indices):
                out[i] = values[start:start + c]
                start += c
        return out

    # -------------------------------------------------------------------------- weights
    def can_lend_weights(self) -> bool:
        """Whether :meth:`iter_weights` can yield the live parameters themselves (``live=True``):
        one rank, where every parameter's local shard is the whole tensor."""
        return self.world_size == 1

    def iter_weights(
        self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | None = None, live: bool = False,
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full HF-named tensors in buckets of at most ``bucket_bytes`` (a larger tensor goes alone).

        Collective (every rank gathers every tensor in the same order). Names are exactly those
        of ``AutoModelForCausalLM.state_dict()``, tied ``lm_head.weight`` included (the same
        tensor as the embedding). Tensors are on this rank's device, cast to ``dtype`` (default:
        the run dtype), and never alias the live parameters.

        ``live=True`` (only where :meth:`can_lend_weights`): the parameters' own tensors instead,
        in their training dtype, with no gather, cast or copy; ``dtype`` only sizes the buckets.
        They change with the next optimizer step, so they are for a consumer that copies them at
        once (an ``InferenceBackend`` with ``accepts_live_weights``).
        """
        dtype = dtype or self.dtype
        if live and not self.can_lend_weights():
            raise ValueError("iter_weights(live=True) needs a single rank (each parameter whole on it)")
        self.model.reshard()
        named = self.hf_model.state_dict(keep_vars=True)  # the parameters themselves: no per-tensor detach
        # Tied weights are one parameter under several names: gather once, yield under each name.
        aliases: dict[int, list[str]] = {}
        for name, p in self.hf_model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        canonical = {n: names[0] for names in aliases.values() for n in names}
        remaining = {names[0]: len(names) for names in aliases.values()}
        cache: dict[str, torch.Tensor] = {}
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in named.items():
            src = canonical.get(name, name)
            if src in cache:
                full, nbytes = cache[src], 0
            else:
                with torch.no_grad():  # the state dict holds the parameters themselves (keep_vars)
                    full = self._lent(tensor) if live else self._full(tensor, dtype)
                nbytes = full.numel() * (dtype.itemsize if live and full.is_floating_point() else full.element_size())
            left = remaining.get(src, 1) - 1
            remaining[src] = left
            if left > 0:
                cache[src] = full
            else:
                cache.pop(src, None)
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, full))
            size += nbytes
        if bucket:
            yield bucket

    @staticmethod
    def _lent(tensor: torch.Tensor) -> torch.Tensor:
        """The whole tensor behind a one-rank parameter, detached, not copied."""
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        if tuple(local.shape) != tuple(tensor.shape):
            raise RuntimeError(f"parameter of shape {tuple(tensor.shape)} has a local shard of {tuple(local.shape)}")
        return local.detach()

    @staticmethod
    def _full(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(tensor, DTensor):
            local = tensor._local_tensor
            # One rank: the local shard is the whole tensor; skip the all-gather (a copy and a
            # collective launch per tensor).
            whole = tensor.device_mesh.size() == 1 and tuple(local.shape) == tuple(tensor.shape)
            full = local if whole else tensor.full_tensor()
        else:
            local = full = tensor
        full = full.detach()
        if full.is_floating_point():
            full = full.to(dtype)
        if full.data_ptr() == local.data_ptr():
            full = full.clone()
        return full

    def full_state_dict(
        self, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
    ) -> dict[str, torch.Tensor]:
        """The whole HF state dict on rank 0 of the group (empty elsewhere). Collective."""
        out: dict[str, torch.Tensor] = {}
        for bucket in self.iter_weights(dtype=dtype):
            if self.rank == 0:
                out.update((n, t.to(device)) for n, t in bucket)
        return out

    def save_hf(self, out_dir: str | Path, tokenizer=None, dtype: torch.dtype | None = None) -> Path:
        """Write an HF model dir (safetensors, config, generation config, tokenizer) atomically. Collective."""
        from transformers import AutoModelForCausalLM

        from rlcli.tokenizer import save_tokenizer

        out = Path(out_dir)
        dtype = dtype or self.dtype
        state = self.full_state_dict(dtype=dtype)
        if self.rank == 0:
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            config = copy.deepcopy(self.hf_model.config)
            config.use_cache = True
            with torch.device("meta"):
                plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
            plain.load_state_dict(state, strict=True, assign=True)
            if self.tied:
                plain.tie_weights()
            plain.generation_config = copy.deepcopy(self.hf_model.generation_config)
            # Recent transformers write only on global rank 0 of the job; the writer is rank 0 of this
            # worker's group (not global rank 0 when other ranks do rollout), and it holds the full state.
            plain.should_save_on_this_rank = lambda is_main_process=True: bool(is_main_process)
            plain.save_pretrained(str(tmp))
            if tokenizer is not None:
                save_tokenizer(tokenizer, tmp, builtin=getattr(tokenizer, "_rlcli_builtin", None))
            publish_dir(tmp, out)
        barrier(self.group)
        return out

    # ---------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str | Path, extra_state: dict[str, Any] | None = None,
                        *, no_optimizer: bool = False) -> Path:
        """DCP model (+ optimizer) + scheduler + RNG + ``extra_state``, atomically. Collective."""
        self.model.reshard()
        return ckpt.save_checkpoint(path, self.model, self.optimizer, self.scheduler, extra_state,
                                    no_optimizer=no_optimizer)

    def load_checkpoint(self, path: str | Path, *, load_optimizer: bool = True,
                        weights_only: bool = False) -> dict[str, Any]:
        """Restore what :meth:`save_checkpoint` wrote; returns the ``extra_state``. Collective.

        ``weights_only``: restore the model weights alone (no optimizer, LR schedule or RNG), e.g.
        to evaluate a checkpoint. ``load_optimizer=False`` keeps the current optimizer state.
        """
        self.model.reshard()
        if weights_only:
            return ckpt.load_checkpoint(path, self.model, None, None, load_optimizer=False, restore_rng=False)
        return ckpt.load_checkpoint(path, self.model, self.optimizer, self.scheduler, load_optimizer=load_optimizer)

    def rng_state_dict(self) -> dict[str, Any]:
        return ckpt.capture_rng_state()

    def load_rng_state_dict(self, state: dict[str, Any]) -> None:
        ckpt.restore_rng_state(state)

    @property
    def optimizer_steps_done(self) -> int:
        return int(self.scheduler.last_epoch)

    def close(self) -> None:
        """Drop the model and optimizer (the process group stays; see :func:`rlcli.dist.destroy`)."""
        self.optimizer.state.clear()
        del self.optimizer, self.scheduler, self.model, self.hf_model
        self.ref_model = None

