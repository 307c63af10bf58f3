"""Decode attention through PyTorch's SDPA (the engine's ``attention: sdpa`` path) and the choice
of SDPA kernels; the Triton path is :mod:`rlcli.backends.decode_attention`."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def _attention_backends(device: torch.device, allow_cudnn: bool):
    """Context choosing SDPA kernels. On CUDA, cuDNN attention builds a plan for every new
    input shape (tens of ms each), which is ruinous when shapes change from step to step, so it
    is excluded except inside captured CUDA graphs, where each shape is seen once."""
    if device.type != "cuda" or allow_cudnn:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def decode_mask(positions: torch.Tensor, key_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """``[n, 1, 1, L]`` booleans: row ``i`` sees cache position ``key_pos[j]`` when it is at or
    before ``positions[i]`` (and within ``window`` of it)."""
    visible = key_pos[None, :] <= positions[:, None]
    if window is not None:
        visible = visible & (key_pos[None, :] > positions[:, None] - window)
    return visible.view(positions.shape[0], 1, 1, key_pos.shape[0])


def sdpa_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Decode attention through SDPA: ``q`` ``[n, H, hd]`` against cache rows ``0..n-1`` up to
    ``mask.shape[-1]`` (a :func:`decode_mask`); returns ``[n, H, hd]``. The query heads that
    share a KV head are laid out as ``[n, KVH, group, hd]``, so plain SDPA handles grouped-query
    attention without repeating the cache."""
    n, num_heads, hd = q.shape
    kvh, key_len = k_cache.shape[1], mask.shape[-1]
    keys, values = k_cache[:n, :, :key_len], v_cache[:n, :, :key_len]
    if keys.dtype != q.dtype:
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    attn = F.scaled_dot_product_attention(q.view(n, kvh, num_heads // kvh, hd), keys, values, attn_mask=mask,
                                          scale=scale)
    return attn.reshape(n, num_heads, hd)
