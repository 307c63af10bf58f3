"""Gradient clipping and the AdamW step on the local shards of FSDP2's DTensors.

Both give the results of ``torch.nn.utils.clip_grad_norm_`` and ``AdamW.step()`` without
dispatching every tensor through DTensor (host time, with the GPU idle) and without a host sync.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as adamw_functional


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

