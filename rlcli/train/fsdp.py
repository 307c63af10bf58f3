"""FSDP2 wrapping of a policy (or reference) model: every decoder layer, then the root."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from rlcli.compiling import layer_compile_kwargs

if TYPE_CHECKING:
    from rlcli.config import FSDPConfig
    from rlcli.train.logprobs import PolicyModel

#: ``fsdp.param_dtype`` / ``fsdp.reduce_dtype`` names.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def shard(model: PolicyModel, fs: FSDPConfig, mesh: DeviceMesh, device: torch.device, param_dtype: torch.dtype,
          cpu_offload: bool) -> None:
    """``fully_shard`` every decoder layer of ``model.lm``, then the root (policy and reference alike)."""
    reduce_dtype = DTYPES[fs.reduce_dtype]
    offload_to_cpu = cpu_offload and device.type == "cuda"
    offload: OffloadPolicy = CPUOffloadPolicy() if offload_to_cpu else OffloadPolicy()
    layer_mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # The root's inputs are ids and float32 temperatures: never cast them to the param dtype.
    root_mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    if not offload_to_cpu:
        model.lm.to(device)
    for layer in decoder_layers(model.lm):
        if fs.torch_compile:
            layer.compile(**layer_compile_kwargs(fs.activation_memory_budget))
        fully_shard(layer, mesh=mesh, mp_policy=layer_mp, offload_policy=offload,
                    reshard_after_forward=fs.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=root_mp, offload_policy=offload)


def decoder_layers(lm: nn.Module) -> list[nn.Module]:
    layers = getattr(lm.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"{type(lm).__name__}: cannot find the decoder layers (expected .layers)")
    return list(layers)
