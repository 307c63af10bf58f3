"""Gradient clipping and the AdamW step on the local shards of FSDP2's DTensors; AdamW with its
moments in bfloat16 (``optimizer.moment_dtype``).

The first two give the results of ``torch.nn.utils.clip_grad_norm_`` and ``AdamW.step()`` without
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


MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state names, as torch.optim.AdamW has them


class MomentDtypeAdamW(torch.optim.Optimizer):
    """AdamW whose two moment estimates are stored in ``moment_dtype`` (``optimizer.moment_dtype``).

    The update is ``torch.optim.AdamW``'s (decoupled weight decay, bias correction, ``eps`` added
    to the corrected root of the second moment), computed in float32 and applied to the float32
    master weights; only the stored moments are rounded. With bfloat16 moments the optimizer holds
    4 bytes a parameter instead of 8, so a full fine-tune needs 12 bytes a parameter (weights,
    gradients, moments) instead of 16: 91 GB instead of 122 GB for a 7B model. With it a 7B
    shape trained on one H200 beside its engine, nothing offloaded (peak 122.4 GiB of 139.8;
    docs/benchmarks.md, "Fourth runs"). Moments in bfloat16 with
    float32 master weights are what DeepSeek-V3 trained with; bfloat16 *weights* would lose updates
    below their 8-bit mantissa (an lr of 1e-6 on a weight of 0.02), and are not offered.

    Large tensors are updated ``chunk`` elements at a time, bounding the float32 scratch (three
    chunks) whatever the largest tensor (the 7B shape's embedding is 545M elements). The moments
    are DTensors beside DTensor parameters, so checkpoints save them as they save AdamW's.
    """

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 moment_dtype: torch.dtype = torch.bfloat16, chunk: int = 1 << 24):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.moment_dtype, self.chunk = moment_dtype, chunk

    def load_state_dict(self, state_dict: dict) -> None:
        """``Optimizer.load_state_dict``, keeping the moments in ``moment_dtype``: torch's own casts
        every floating-point state to its parameter's dtype, which would turn them into float32 on
        resume (twice the memory, and another run's numbers). They are set aside before it runs and
        put in after, converted only when the checkpoint holds another dtype (a switch of
        ``moment_dtype`` between runs)."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = dict(zip(saved_ids, (p for g in self.param_groups for p in g["params"])))
        moments = {i: {k: v for k, v in st.items() if k in MOMENTS} for i, st in state_dict["state"].items()}
        rest = {i: {k: v for k, v in st.items() if k not in MOMENTS} for i, st in state_dict["state"].items()}
        super().load_state_dict({**state_dict, "state": rest})
        for st in self.state.values():  # a fused AdamW's checkpoint keeps its step count on the device
            if "step" in st:
                st["step"] = st["step"].to("cpu", torch.float32)  # step() reads it on every parameter
        for i, kv in moments.items():
            p = params[i]
            for k, v in kv.items():
                self.state[p][k] = v.to(device=p.device, dtype=self.moment_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)  # on the host: no device sync to read
                    st["exp_avg"] = torch.zeros_like(p, dtype=self.moment_dtype, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=self.moment_dtype, memory_format=torch.preserve_format)
                st["step"] += 1
                self._update(_local(p), _local(p.grad), _local(st["exp_avg"]), _local(st["exp_avg_sq"]),
                             int(st["step"].item()), group)
        return loss

    def _update(self, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
                group: dict) -> None:
        lr, (beta1, beta2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
        bias1, bias2_sqrt = 1 - beta1 ** step, math.sqrt(1 - beta2 ** step)
        if wd:
            p.mul_(1 - lr * wd)
        tensors = (p, g, m, v)
        if all(t.is_contiguous() for t in tensors):
            chunks = zip(*(t.view(-1).split(self.chunk) for t in tensors))
        else:  # whole tensors (not seen with FSDP2's shards, which are contiguous)
            chunks = [tensors]
        for pc, gc, mc, vc in chunks:
            g32 = gc.float()
            m32 = mc.float().lerp_(g32, 1 - beta1)  # float32 moments: these are the state itself
            v32 = vc.float().mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
            if m32.data_ptr() != mc.data_ptr():
                mc.copy_(m32)
                vc.copy_(v32)
            pc.addcdiv_(m32, v32.sqrt().div_(bias2_sqrt).add_(eps), value=-lr / bias1)
