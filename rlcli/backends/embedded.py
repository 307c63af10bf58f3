"""The built-in inference backend: a continuous-batching engine in pure PyTorch.

``EmbeddedBackend`` (registered as ``embedded``) serves the RL loop from the process that runs
it: no server, no extra dependency, the same code on a laptop CPU (float32) and on a GPU
(bfloat16). It is built from three parts:

* :class:`LlamaFamilyModel` - a batched prefill/decode forward for the llama family (model types
  ``llama``, ``mistral``, ``qwen2``, ``qwen3``). It reuses the Hugging Face model's own modules
  (embedding, q/k/v/o projections, RMSNorms, q/k norms, MLP, lm_head and the model's
  ``rotary_emb``, so every RoPE scaling variant stays correct) and replaces only attention and
  the KV cache.
* :class:`KVCache` - per layer, one preallocated ``[max_batch_size, kv_heads, max_model_len,
  head_dim]`` tensor for keys and one for values. Active sequences always occupy rows
  ``0..B-1`` ("slot compaction": when a sequence finishes, the last active rows move into the
  freed rows), so decode attention reads the contiguous views ``cache[:B, :, :L]`` with no
  gather.
* :class:`EmbeddedEngine` - the synchronous scheduler. One :meth:`~EmbeddedEngine.step` admits
  waiting requests into free rows (their prompts are prefilled in padded batches of at most
  ``max_prefill_tokens``; identical prompts admitted together - the ``prompt_repeat_k`` copies
  of a group - are prefilled once and their KV written to every copy's row), then runs one
  batched decode step for all active rows. Sampling happens on the device; the only
  device-to-host transfer of a decode step is one boolean per row ("sampled a stop token"),
  and token ids, logprobs and versions stay in device buffers until a sequence finishes.

Sampling is a function of (request seed, token position, logits) only: each row draws one
uniform number from a counter-based hash of its seed and the absolute position of the token
and inverts the CDF of its (temperature-scaled, top-k/top-p filtered) distribution. A request
therefore yields the same tokens whatever else is in the batch and whenever it is admitted, and
a partial response continued with the same seed draws the same numbers it would have drawn
uninterrupted. (Logits themselves can differ in the last bits with the batch shape - more so on
GPUs, where matrix kernels are chosen per shape - so a draw within that distance of a CDF
boundary could still flip.) The logprob returned for a token is ``log_softmax(logits / T)`` with ``T`` the
temperature (1.0 for greedy) and *no* top-k/top-p renormalisation, which is what the trainer
recomputes.

CPU vs GPU: everything here runs on both; nothing is CPU-only. On CUDA with ``cuda_graphs:
true`` the decode forward runs on bucketed shapes (rows padded to 1, 2, 4, ..., 32 then
multiples of 32; key length padded to a multiple of 128, 512 past 1024, a power of two past
4096) and each shape's forward is captured once into a CUDA graph (:class:`CudaGraphDecoder`) and
replayed afterwards; ``sleep(1)`` keeps the graphs when the KV cache comes back at the same address. Prefill and
sampling run eagerly (outside graphs, cuDNN attention is avoided: it plans per shape). The cache is a dense per-row tensor (no paging), sized
``max_batch_size x max_model_len``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from rlcli.backends.base import BackendContext, GenerateOutput, GenerateRequest, InferenceBackend
from rlcli.backends.decode_attention import decode_attention_op, triton_decode_attention_available
from rlcli.compiling import compile_rows_dynamic
from rlcli.component import ComponentConfig
from rlcli.types import SampleParams

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
"""Hugging Face ``model_type`` values the embedded engine can run."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# ------------------------------------------------------------------------------------------
# Counter-based randomness
# ------------------------------------------------------------------------------------------
_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
# Multiplier of a well-mixing 32-bit integer hash; below 2**31, so products of 32-bit values
# stay below 2**63 and int64 tensor arithmetic never overflows.
_HASH_MUL = 0x45D9F3B


def _splitmix64(x: int) -> int:
    """One step of the splitmix64 generator (exact Python integer arithmetic)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def seed_keys(seed: int) -> tuple[int, int]:
    """The two 32-bit hash keys a request's seed (any Python int) is reduced to."""
    h1 = _splitmix64(seed & _M64)
    h2 = _splitmix64(h1)
    return h1 & _M32, h2 & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Avalanche a tensor of 32-bit values held in int64 (no overflow: see ``_HASH_MUL``)."""
    x = x ^ (x >> 16)
    x = (x * _HASH_MUL) & _M32
    x = x ^ (x >> 16)
    x = (x * _HASH_MUL) & _M32
    return x ^ (x >> 16)


def counter_uniform(key1: torch.Tensor, key2: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Uniform numbers in ``[0, 1 - 2**-23]`` from (keys, position), elementwise, as float32.

    A pure function of its inputs (no generator state), so a row's random number depends on its
    own seed and token position only, never on the batch it is computed in. 23 bits keep
    ``u * total < total`` exact in float32, which :func:`sample_tokens` relies on.
    """
    x = _mix32(_mix32((position & _M32) ^ key1) ^ key2)
    return (x >> 9).to(torch.float32) * (2.0**-23)


# ------------------------------------------------------------------------------------------
# Sampling
# ------------------------------------------------------------------------------------------
def filter_top_k_top_p(
    scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, *, use_top_p: bool, max_top_k: int
) -> torch.Tensor:
    """Set to ``-inf`` the scores outside each row's top-k / top-p (nucleus) set.

    ``top_k`` is int64 ``[n]`` (0 = off), ``top_p`` float ``[n]`` (1.0 = off); top-p applies to
    the distribution renormalised over the top-k set. The kept set is cut by value, so tokens
    tied with the last kept one are kept too (deterministic whatever the sort order of ties).
    ``use_top_p=False`` takes the cheaper ``topk(max_top_k)`` path (then no row may use top-p).
    """
    n, vocab = scores.shape
    neg_inf = torch.tensor(float("-inf"), dtype=scores.dtype, device=scores.device)
    if use_top_p:
        srt = scores.sort(dim=-1, descending=True).values
        rank = torch.arange(vocab, device=scores.device)
        keep = (top_k[:, None] == 0) | (rank[None, :] < top_k[:, None])
        probs = torch.softmax(srt.masked_fill(~keep, float("-inf")), dim=-1)
        cum = probs.cumsum(dim=-1)
        cum_before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
        keep &= (cum_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
        n_keep = keep.sum(dim=-1).clamp_min(1)
        thresh = srt.gather(1, (n_keep - 1)[:, None])
    else:
        k_max = max(1, min(int(max_top_k), vocab))
        vals = scores.topk(k_max, dim=-1).values
        k = torch.where(top_k > 0, top_k.clamp(max=k_max), torch.full_like(top_k, k_max))
        thresh = vals.gather(1, (k - 1)[:, None])
        thresh = torch.where(top_k[:, None] > 0, thresh, neg_inf)
    return scores.masked_fill(scores < thresh, float("-inf"))


def _cdf_block(vocab: int) -> int:
    """Block width of the two-level CDF: the whole vocabulary when it has at most 1024 tokens (one
    block), else the largest power of two up to 1024 that divides it (no padding), else 1024 (the
    scores are padded with ``-inf``)."""
    if vocab <= 1024:
        return vocab
    for b in (1024, 512, 256, 128):
        if vocab % b == 0:
            return b
    return 1024


def _inverse_cdf(scores: torch.Tensor, row_max: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token per row where the CDF of ``exp(scores - row_max)`` first exceeds ``uniform * total``,
    and ``total`` (the sum of those weights, ``[n, 1]``).

    Two levels, so nothing of the vocabulary's size is scanned or stored in float32: the sums of
    blocks of ``_cdf_block(V)`` scores pick the block (a scan over ``V / block`` numbers), then a
    scan inside that one block picks the token. ``uniform * total < total`` (as
    :func:`counter_uniform` guarantees) keeps the choice on a token of positive weight; rounding
    between the two levels is clamped to the chosen block's last positive weight.
    """
    n, vocab = scores.shape
    width = _cdf_block(vocab)
    pad = -vocab % width
    if pad:
        scores = F.pad(scores, (0, pad), value=float("-inf"))
    blocks = scores.view(n, -1, width)
    block_sum = (blocks - row_max.unsqueeze(-1)).exp().sum(dim=-1)  # [n, nb]
    block_cum = block_sum.cumsum(dim=-1)
    total = block_cum[:, -1:]
    target = uniform.unsqueeze(1) * total
    block = torch.searchsorted(block_cum, target, right=True).clamp_(max=block_sum.shape[1] - 1)  # [n, 1]
    before = block_cum.gather(1, block) - block_sum.gather(1, block)
    weights = (blocks.gather(1, block.unsqueeze(-1).expand(n, 1, width)).squeeze(1) - row_max).exp()  # [n, width]
    within = torch.searchsorted(weights.cumsum(dim=-1), (target - before).clamp_min(0), right=True)
    lane = torch.arange(width, device=scores.device)
    last = torch.where(weights > 0, lane, torch.zeros_like(lane)).amax(dim=-1, keepdim=True)
    tok = block * width + torch.minimum(within, last)
    return tok.squeeze(1), total


def sample_tokens(scores: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from ``softmax(scores)`` by inverting its CDF at ``uniform``.

    ``uniform`` must lie in ``[0, 1)`` with ``uniform * total < total`` in float32 (as
    :func:`counter_uniform` guarantees); the chosen token then always has positive probability.
    """
    tok, _ = _inverse_cdf(scores, scores.amax(dim=-1, keepdim=True), uniform)
    return tok


def sample_plain(
    logits: torch.Tensor, temperature: torch.Tensor | None, uniform: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token and its logprob per row of ``softmax(logits / temperature)``, no filtering.

    The same draw as :func:`sample_tokens` (inverse CDF at ``uniform``) with the log-normaliser
    taken from the same pass, as plain tensor math that ``torch.compile`` fuses into a few passes
    over the logits. ``logits`` may be half precision (upcast here).
    """
    x = logits.float()
    if temperature is not None:
        x = x / temperature.unsqueeze(1)
    m = x.amax(dim=-1, keepdim=True)
    tok, total = _inverse_cdf(x, m, uniform)
    logprob = x.gather(1, tok.unsqueeze(1)) - m - total.log()
    return tok, logprob.squeeze(1)


def sample_plain_keyed(
    logits: torch.Tensor, temperature: torch.Tensor | None, key1: torch.Tensor, key2: torch.Tensor,
    position: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_plain` at ``counter_uniform(key1, key2, position)``: one function, so that
    ``torch.compile`` also fuses the hash's two dozen integer operations (one kernel launch
    each when eager) into its kernels."""
    return sample_plain(logits, temperature, counter_uniform(key1, key2, position))


# ------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------
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


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the "rotate half" convention of the Hugging Face llama family."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _fuse_rows(params: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate ``params`` along dim 0 into one new tensor and point each parameter's data at
    its rows of it (in-place updates of a parameter then write into the fused tensor)."""
    fused = torch.cat([p.data for p in params], dim=0)
    start = 0
    for p in params:
        p.data = fused[start: start + p.shape[0]]
        start += p.shape[0]
    return fused


@dataclass
class _Layer:
    input_norm: torch.nn.Module
    q_proj: torch.nn.Module
    k_proj: torch.nn.Module
    v_proj: torch.nn.Module
    o_proj: torch.nn.Module
    q_norm: torch.nn.Module | None
    k_norm: torch.nn.Module | None
    post_norm: torch.nn.Module
    mlp: torch.nn.Module
    scale: float
    window: int | None  # sliding-window width, None = full attention
    # q/k/v and gate/up projections as one matrix each (see LlamaFamilyModel.fuse_projections);
    # None when not fused
    qkv_weight: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None
    gate_up_weight: torch.Tensor | None = None


class LlamaFamilyModel:
    """Batched prefill and decode over a Hugging Face llama-family causal LM.

    Uses the HF model's modules as they are (so in-place weight updates are seen at once) and
    implements attention against a :class:`KVCache`. Supported: RMSNorm, RoPE (through the
    model's own ``rotary_emb``), grouped-query attention, SwiGLU MLP, q/k/v biases (qwen2), q/k
    norms (qwen3), sliding-window layers, tied embeddings.
    """

    def __init__(self, hf_model: torch.nn.Module):
        cfg = hf_model.config
        model_type = getattr(cfg, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"the embedded backend does not support model_type {model_type!r}; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (use another inference backend for this model)"
            )
        base = getattr(hf_model, "model", None)
        if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
            raise ValueError(f"unexpected module layout for a {model_type} model: {type(hf_model).__name__}")
        self.hf = hf_model
        self.config = cfg
        self.model_type = model_type
        self.embed = base.embed_tokens
        self.final_norm = base.norm
        self.rotary = base.rotary_emb
        self.lm_head = hf_model.lm_head
        attn0 = base.layers[0].self_attn
        self.head_dim = int(getattr(attn0, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.num_heads = attn0.q_proj.out_features // self.head_dim
        self.num_kv_heads = attn0.k_proj.out_features // self.head_dim
        self.vocab_size = int(self.lm_head.out_features)
        self.max_position_embeddings = int(getattr(cfg, "max_position_embeddings", 4096) or 4096)
        self._named: dict[str, torch.Tensor] | None = None  # named_parameters(), built on first use
        self._layer_fn = self._decode_layer  # torch.compile'd by compile_decode()
        self.triton_attention = False  # decode attention through the Triton kernel (use_triton_attention)
        self.layers: list[_Layer] = []
        for layer in base.layers:
            attn = layer.self_attn
            if hasattr(attn, "sliding_window"):
                window = attn.sliding_window
            else:
                window = getattr(cfg, "sliding_window", None) if model_type == "mistral" else None
            self.layers.append(
                _Layer(
                    input_norm=layer.input_layernorm,
                    q_proj=attn.q_proj,
                    k_proj=attn.k_proj,
                    v_proj=attn.v_proj,
                    o_proj=attn.o_proj,
                    q_norm=getattr(attn, "q_norm", None),
                    k_norm=getattr(attn, "k_norm", None),
                    post_norm=layer.post_attention_layernorm,
                    mlp=layer.mlp,
                    scale=float(getattr(attn, "scaling", self.head_dim**-0.5)),
                    window=int(window) if window else None,
                )
            )
        self.fuse_projections()

    @torch.no_grad()
    def fuse_projections(self) -> None:
        """Give each layer one ``[q; k; v]`` and one ``[gate; up]`` weight matrix, and make the
        Hugging Face parameters views into them.

        A decode step multiplies a few hundred rows by each matrix; at that size a matrix
        product costs about the same whatever its width, so three (or two) products become one
        (prefill and decode both use them). The parameters stay the model's own (views), so
        in-place weight updates and state-dict names are unchanged. Layers whose projections
        differ in kind (bias on some only, or an MLP without ``gate_proj``/``up_proj``) are left
        as they are. :meth:`to` re-fuses after the weights have moved (``.to()`` replaces the
        views by copies).
        """
        for layer in self.layers:
            projs = (layer.q_proj, layer.k_proj, layer.v_proj)
            biases = [p.bias for p in projs]
            layer.qkv_weight = layer.qkv_bias = layer.gate_up_weight = None
            if all(isinstance(p, torch.nn.Linear) for p in projs) and (
                    all(b is None for b in biases) or all(b is not None for b in biases)):
                layer.qkv_weight = _fuse_rows([p.weight for p in projs])
                if biases[0] is not None:
                    layer.qkv_bias = _fuse_rows(biases)
            mlp = layer.mlp
            gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
            if (isinstance(gate, torch.nn.Linear) and isinstance(up, torch.nn.Linear) and gate.bias is None
                    and up.bias is None and hasattr(mlp, "down_proj") and hasattr(mlp, "act_fn")):
                layer.gate_up_weight = _fuse_rows([gate.weight, up.weight])

    def to(self, device: torch.device | str) -> None:
        """Move the weights: to the CPU for ``sleep(2)`` (the fused matrices are dropped with
        the device memory; nothing decodes while asleep) and back for ``wake_up`` (fused again)."""
        self.hf.to(device)
        self._named = None  # parameters keep their objects across a move, buffers may not
        if torch.device(device).type == "cpu":
            for layer in self.layers:
                layer.qkv_weight = layer.qkv_bias = layer.gate_up_weight = None
        else:
            self.fuse_projections()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    # -------------------------------------------------------------------------- weights
    def named_parameters(self) -> dict[str, torch.Tensor]:
        """HF state-dict names -> live tensors (tied weights appear under both names). Built once
        and again after :meth:`to` (fusing projections changes the parameters' data, not the objects)."""
        if self._named is None:
            self._named = dict(self.hf.state_dict(keep_vars=True))
        return self._named

    @torch.no_grad()
    def load_named_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors into the model in place; returns how many names were given.

        All names and shapes are checked before anything is copied, so a bad call changes
        nothing. Raises ``ValueError`` naming every unknown name / mismatched shape. Names of one
        tied parameter (``lm_head.weight`` and the embedding) are copied once per call, from the
        first of them (the trainer sends the same tensor under both).
        """
        items = list(named_tensors)
        params = self.named_parameters()
        unknown = [name for name, _ in items if name not in params]
        if unknown:
            sample = ", ".join(sorted(params)[:3])
            raise ValueError(
                f"update_weights: {len(unknown)} unknown tensor name(s): {', '.join(unknown)} "
                f"(expected Hugging Face state_dict names such as {sample}, ...)"
            )
        bad = [
            f"{name} {tuple(t.shape)} (model has {tuple(params[name].shape)})"
            for name, t in items
            if tuple(t.shape) != tuple(params[name].shape)
        ]
        if bad:
            raise ValueError(f"update_weights: shape mismatch for {', '.join(bad)}")
        written: set[int] = set()  # tied weights: one parameter under several names, copied once
        for name, tensor in items:
            param = params[name]
            if id(param) in written:
                continue
            written.add(id(param))
            param.data.copy_(tensor.detach(), non_blocking=True)
        return len(items)

    # -------------------------------------------------------------------------- forward
    def _qkv(self, layer: _Layer, x: torch.Tensor, shape: tuple[int, ...]):
        hd = self.head_dim
        if layer.qkv_weight is not None:
            qkv = F.linear(x, layer.qkv_weight, layer.qkv_bias)
            q, k, v = qkv.split([self.num_heads * hd, self.num_kv_heads * hd, self.num_kv_heads * hd], dim=-1)
            q, k, v = q.view(*shape, self.num_heads, hd), k.view(*shape, self.num_kv_heads, hd), v.view(
                *shape, self.num_kv_heads, hd)
        else:
            q = layer.q_proj(x).view(*shape, self.num_heads, hd)
            k = layer.k_proj(x).view(*shape, self.num_kv_heads, hd)
            v = layer.v_proj(x).view(*shape, self.num_kv_heads, hd)
        if layer.q_norm is not None:
            q = layer.q_norm(q)
        if layer.k_norm is not None:
            k = layer.k_norm(k)
        return q, k, v

    def prefill(
        self,
        input_ids: torch.Tensor,
        last_index: torch.Tensor,
        cache: "KVCache",
        dest_rows: torch.Tensor,
        src_index: torch.Tensor,
    ) -> torch.Tensor:
        """Run right-padded prompts ``[c, L]`` from position 0; returns float32 logits ``[c, V]``.

        The keys/values of prompt ``src_index[i]`` are written into cache row ``dest_rows[i]``
        (positions ``0..L-1``; padded positions hold junk that is never attended to), which is
        how one prompt is shared by many rows. ``last_index[j]`` is the last real position of
        prompt ``j``; only there are the final norm and lm_head computed. Right padding with a
        causal mask never lets a real position attend to padding.
        """
        c, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device).unsqueeze(0).expand(c, length)
        h = self.embed(input_ids)
        cos, sin = self.rotary(h, positions)  # [c, L, hd]
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # broadcast over heads
        gqa = self.num_heads != self.num_kv_heads
        rows = torch.arange(c, device=input_ids.device)
        last_layer = len(self.layers) - 1
        with _attention_backends(h.device, allow_cudnn=False):
            for i, layer in enumerate(self.layers):
                x = layer.input_norm(h)
                q, k, v = self._qkv(layer, x, (c, length))
                q = _rope(q, cos, sin).transpose(1, 2)  # [c, H, L, hd]
                k = _rope(k, cos, sin).transpose(1, 2)  # [c, KVH, L, hd]
                v = v.transpose(1, 2)
                cache.write_prefill(i, dest_rows, src_index, k, v)
                if layer.window is not None and length > layer.window:
                    qi = torch.arange(length, device=h.device)
                    diff = qi[:, None] - qi[None, :]
                    mask = (diff >= 0) & (diff < layer.window)
                    attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scale, enable_gqa=gqa)
                else:
                    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.scale, enable_gqa=gqa)
                attn = attn.transpose(1, 2).reshape(c, length, self.num_heads * self.head_dim)
                h = h + layer.o_proj(attn)
                if i == last_layer:  # only the last position of each prompt is needed from here on
                    h = h[rows, last_index]
                h = h + self._mlp(layer, layer.post_norm(h))
        return self.lm_head(self.final_norm(h)).float()

    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: "KVCache", key_len: int, allow_cudnn: bool = False,
        out: torch.Tensor | None = None, prefix: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One token for each of cache rows ``0..n-1``; returns logits ``[n, V]`` in the model dtype.

        Row ``i`` feeds ``tokens[i]`` at ``positions[i]``, writes its key/value there and
        attends to cache positions ``0..positions[i]`` (keys beyond are masked; ``key_len`` must
        exceed every position). The query heads that share a KV head are laid out as
        ``[n, KVH, group, hd]`` so plain SDPA handles grouped-query attention without repeating
        the cache. ``allow_cudnn`` lets SDPA pick cuDNN attention on CUDA (only worth it when the
        shape repeats, as under CUDA-graph replay). ``out`` (``[n, V]``, contiguous) receives the
        logits, written by the output projection itself (no copy of the ``[n, V]`` tensor).
        ``prefix`` (``rows``, ``lengths``, integer ``[n]``): with Triton attention, row ``i`` reads
        its keys and values below ``lengths[i]`` from cache row ``rows[i]``, which must hold the
        same there (see :func:`~rlcli.backends.decode_attention.decode_attention`); ignored by SDPA.
        """
        with _attention_backends(tokens.device, allow_cudnn):
            try:
                return self._decode(tokens, positions, cache, key_len, out, prefix)
            except Exception:
                if self._layer_fn == self._decode_layer:
                    raise
                log.warning("torch.compile of the decode step failed; decoding eagerly from now on", exc_info=True)
                self._layer_fn = self._decode_layer
                return self._decode(tokens, positions, cache, key_len, out, prefix)

    def use_triton_attention(self) -> None:
        """Decode attention through :mod:`rlcli.backends.decode_attention` (reads each row's keys
        and values once per query-head group and only up to its position) instead of SDPA over
        the padded key bucket with a mask. Needs a CUDA device (or Triton's CPU interpreter) and
        a KV cache in the model dtype."""
        if not triton_decode_attention_available(self.device):
            raise ValueError("Triton decode attention needs the triton package and a CUDA device")
        self.triton_attention = True

    def compile_decode(self) -> None:
        """Run each decoder layer of :meth:`decode` through ``torch.compile``, which fuses its norms,
        rotary embedding, cache write, residual adds and activation into a few kernels. One
        compilation serves every layer, batch size and key length (those two dimensions are the
        only symbolic ones: model sizes stay constants, see :mod:`rlcli.compiling`); the first
        decode step pays it."""
        # arguments: layer, h, attn_out, mlp_out, cos, sin, k_cache, v_cache, rows, positions, key_pos, mask,
        # prefix_rows, prefix_lens
        self._layer_fn = compile_rows_dynamic(self._decode_layer, dims={
            1: (0,), 2: (0,), 3: (0,), 4: (0,), 5: (0,), 8: (0,), 9: (0,), 10: (0,), 11: (0, 3), 12: (0,), 13: (0,)})

    def _decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: "KVCache", key_len: int,
                out: torch.Tensor | None = None,
                prefix: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        n = tokens.shape[0]
        h = self.embed(tokens)  # [n, D]
        cos, sin = self.rotary(h, positions.unsqueeze(1))  # [n, 1, hd]
        key_pos = torch.arange(key_len, device=tokens.device)  # its length carries key_len into compiled layers
        rows = torch.arange(n, device=tokens.device)
        masks: dict[int | None, torch.Tensor | None] = {}  # one per sliding-window width; None: the Triton kernel masks
        prefix_args = prefix if prefix is not None and self.triton_attention else (None, None)
        # Each layer hands its two residual branches to the next one unadded (see _decode_layer).
        attn_out, mlp_out = torch.zeros_like(h), torch.zeros_like(h)  # two tensors: compiled code guards on aliasing
        for i, layer in enumerate(self.layers):
            if layer.window not in masks:
                masks[layer.window] = None if self.triton_attention else decode_mask(positions, key_pos, layer.window)
            h, attn_out, mlp_out = self._layer_fn(layer, h, attn_out, mlp_out, cos, sin, cache.k[i], cache.v[i], rows,
                                                  positions, key_pos, masks[layer.window], *prefix_args)
        h = self.final_norm(h + attn_out + mlp_out)
        if out is None:
            return self.lm_head(h)
        if self.lm_head.bias is None:
            return torch.mm(h, self.lm_head.weight.t(), out=out)
        return out.copy_(self.lm_head(h))

    def _decode_layer(self, layer: _Layer, h: torch.Tensor, attn_out: torch.Tensor, mlp_out: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      rows: torch.Tensor, positions: torch.Tensor, key_pos: torch.Tensor,
                      mask: torch.Tensor | None, prefix_rows: torch.Tensor | None = None,
                      prefix_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decoder layer for one new token per row: writes its key/value into the cache at
        ``positions`` and attends to the cache's first ``len(key_pos)`` positions, through SDPA
        with ``mask`` or, when ``mask`` is None, through the Triton kernel.

        The residual stream arrives as ``h + attn_out + mlp_out`` (the previous layer's input and
        its two branch outputs, added here in the order the model adds them) and leaves the same
        way: ``(input, attention output, MLP output)``. Compiled, the additions then fuse into the
        norms that read them, whereas a residual added right after its output projection becomes
        ``addmm``, whose cuBLAS call first copies the residual into its output (a device-to-device
        copy per branch per layer per decode step)."""
        n = h.shape[0]
        h = h + attn_out + mlp_out
        x = layer.input_norm(h)
        q, k, v = self._qkv(layer, x, (n,))
        q = _rope(q, cos, sin)  # [n, H, hd]
        k = _rope(k, cos, sin)  # [n, KVH, hd]
        k_cache[rows, :, positions] = k.to(k_cache.dtype)
        v_cache[rows, :, positions] = v.to(v_cache.dtype)
        if mask is None:
            attn = decode_attention_op(q, k_cache, v_cache, positions, key_pos.shape[0], layer.scale,
                                       layer.window or 0, prefix_rows, prefix_lens)
        else:
            attn = sdpa_decode_attention(q, k_cache, v_cache, mask, layer.scale)
        attn_out = layer.o_proj(attn.reshape(n, self.num_heads * self.head_dim))
        return h, attn_out, self._mlp(layer, layer.post_norm(h + attn_out))

    @staticmethod
    def _mlp(layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        if layer.gate_up_weight is None:
            return layer.mlp(x)
        mlp = layer.mlp
        gate, up = F.linear(x, layer.gate_up_weight).split([mlp.gate_proj.out_features, mlp.up_proj.out_features], dim=-1)
        return mlp.down_proj(mlp.act_fn(gate) * up)


# ------------------------------------------------------------------------------------------
# KV cache
# ------------------------------------------------------------------------------------------
class KVCache:
    """Preallocated keys and values: per layer ``[rows, kv_heads, max_len, head_dim]``.

    Zero-initialised: attention reads ``cache[:B, :, :L]`` and masks the positions a row has
    not written, and a masked position still contributes ``0 * value``, so every value must be
    finite (uninitialised memory can hold NaN). Positions a row has not written hold zeros or a
    previous occupant's (finite) values. ``free()`` releases the memory (sleep) and
    ``allocate()`` restores it; contents are not preserved.
    """

    def __init__(
        self, n_layers: int, rows: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype, device
    ):
        self.shape = (rows, kv_heads, max_len, head_dim)
        self.n_layers, self.dtype, self.device = n_layers, dtype, torch.device(device)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._buffer: torch.Tensor | None = None
        self.allocate()

    @property
    def allocated(self) -> bool:
        return self._buffer is not None

    @property
    def address(self) -> int | None:
        """Device address of the cache (one buffer holds every layer's keys and values), or None when freed."""
        return None if self._buffer is None else self._buffer.data_ptr()

    def allocate(self) -> None:
        # Always an inference tensor: the compiled decode layers guard on it, and a cache that
        # came back as a different kind of tensor after sleep/wake recompiled them (3-5 s on the H200).
        if self._buffer is None:
            with torch.inference_mode():
                self._buffer = torch.zeros((2, self.n_layers, *self.shape), dtype=self.dtype, device=self.device)
            self.k = list(self._buffer[0].unbind(0))
            self.v = list(self._buffer[1].unbind(0))

    def free(self) -> None:
        self.k, self.v, self._buffer = [], [], None

    def write_prefill(self, layer: int, dest_rows, src_index, k: torch.Tensor, v: torch.Tensor) -> None:
        length = k.shape[2]
        self.k[layer][dest_rows, :, :length] = k[src_index].to(self.dtype)
        self.v[layer][dest_rows, :, :length] = v[src_index].to(self.dtype)

    def move_rows(self, dst: torch.Tensor, src: torch.Tensor, length: int) -> None:
        """Copy rows ``src`` into rows ``dst`` (positions ``0..length-1``), every layer."""
        if length <= 0:
            return
        for t in self.k + self.v:
            t[dst, :, :length] = t[src, :, :length]


# ------------------------------------------------------------------------------------------
# CUDA graphs
# ------------------------------------------------------------------------------------------
class CudaGraphDecoder:
    """Replays CUDA graphs of :meth:`LlamaFamilyModel.decode`, one per ``(rows, key_len)`` shape.

    A decode step of a small model is dominated by the CPU cost of launching several hundred
    kernels; replaying a captured graph launches them all at once. Graphs are captured lazily,
    the first time a shape is seen (the engine rounds shapes to buckets, so there are few), and
    share one memory pool, static input buffers and one static logits buffer, so each extra
    graph costs little memory. Weights updated in place are seen by the graphs; anything that
    reallocates weights or the KV cache (sleep / wake_up) must call :meth:`reset`.
    """

    def __init__(self, model: LlamaFamilyModel, cache: "KVCache", max_rows: int,
                 prefix: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.model, self.cache = model, cache
        self.prefix = prefix  # per-row prefix rows and lengths ([max_rows], fixed addresses): read at replay
        dev = model.device
        with torch.inference_mode():  # like every tensor the engine steps see (compiled code guards on the kind)
            self._tokens = torch.zeros(max_rows, dtype=torch.int64, device=dev)
            self._positions = torch.zeros(max_rows, dtype=torch.int64, device=dev)
            self._logits = torch.zeros(max_rows, model.vocab_size, dtype=model.dtype, device=dev)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.captures = 0  # graphs captured so far (a recapture after a reset counts again)
        # one side stream for every warm-up and capture: libraries keep per-stream workspaces
        self._stream = torch.cuda.Stream(dev)

    @staticmethod
    def supported(model: LlamaFamilyModel) -> bool:
        """False for RoPE variants whose update reads tensor values on the host (not capturable)."""
        rope_type = str(getattr(model.rotary, "rope_type", "default"))
        return "dynamic" not in rope_type and "longrope" not in rope_type

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def reset(self) -> None:
        """Drop every graph (their recorded addresses are stale after reallocation)."""
        self._graphs.clear()
        self._pool = None

    def _forward(self, rows: int, key_len: int) -> None:
        prefix = None if self.prefix is None else (self.prefix[0][:rows], self.prefix[1][:rows])
        self.model.decode(self._tokens[:rows], self._positions[:rows], self.cache, key_len, allow_cudnn=True,
                          out=self._logits[:rows], prefix=prefix)

    def _capture(self, rows: int, key_len: int) -> torch.cuda.CUDAGraph:
        # Warm up eagerly on a side stream (library handles, kernel plans), then capture. Both
        # run the forward with every position at key_len - 1, which is at or past the end of
        # every active row's cache, so nothing valid is overwritten.
        self._tokens[:rows].zero_()
        self._positions[:rows].fill_(key_len - 1)
        stream = self._stream
        current = torch.cuda.current_stream(self.model.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):  # also where torch.compile (re)compiles: never inside a capture
            self._forward(rows, key_len)
        current.wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            self._forward(rows, key_len)
        self._graphs[(rows, key_len)] = graph
        self.captures += 1
        return graph

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, key_len: int) -> torch.Tensor:
        """Same as ``model.decode(tokens, positions, cache, key_len)``; the result is a view of
        a static buffer, valid until the next call."""
        rows = tokens.shape[0]
        graph = self._graphs.get((rows, key_len))
        if graph is None:
            graph = self._capture(rows, key_len)
        self._tokens[:rows].copy_(tokens)
        self._positions[:rows].copy_(positions)
        graph.replay()
        return self._logits[:rows]


# ------------------------------------------------------------------------------------------
# Engine
# ------------------------------------------------------------------------------------------
# columns of the per-row int64 state
_TOK, _CTX, _GEN, _MIN_NEW, _TOP_K, _KEY1, _KEY2, _HAS_STOP, _GREEDY = range(9)
_N_INT = 9
# columns of the per-row float32 state
_TEMP, _TOP_P = range(2)
_N_FLOAT = 2


@dataclass(eq=False)
class Sequence:
    """One request inside the engine."""

    request: GenerateRequest
    prompt: list[int]
    params: SampleParams
    key1: int
    key2: int
    stop_ids: list[int]  # eos (unless ignore_eos) + stop_token_ids, deduplicated
    max_new: int  # max_tokens capped by max_model_len - prompt length
    future: Any = None  # asyncio.Future set by the backend
    cancelled: bool = False
    row: int | None = None
    stop_set: frozenset = field(default_factory=frozenset)

    def __post_init__(self):
        self.stop_set = frozenset(self.stop_ids)


class EmbeddedEngine:
    """The synchronous continuous-batching scheduler behind :class:`EmbeddedBackend`.

    Not thread-safe: :meth:`step`, :meth:`abort_all` and weight/cache changes must be
    serialised by the caller (the backend holds one lock around them). :meth:`submit` and
    :meth:`cancel` may be called from any thread at any time.
    """

    def __init__(
        self,
        model: LlamaFamilyModel,
        *,
        max_batch_size: int,
        max_model_len: int,
        max_prefill_tokens: int,
        eos_token_ids: Iterable[int],
        prefix_sharing: bool = True,
        kv_cache_dtype: torch.dtype | None = None,
        pad_token_id: int | None = None,
        version: int = 0,
        shape_stable_decode: bool = False,
        overlap: bool | None = None,
    ):
        self.model = model
        self.device = model.device
        self.max_batch_size = int(max_batch_size)
        self.max_model_len = int(max_model_len)
        self.max_prefill_tokens = int(max_prefill_tokens)
        self.prefix_sharing = bool(prefix_sharing)
        self.eos_token_ids = [int(e) for e in eos_token_ids]
        self.shape_stable_decode = bool(shape_stable_decode)
        # CPU ops run synchronously, so there is nothing to overlap there, and the extra decode
        # step of a row that stopped would only cost time (much of it with short responses)
        self.overlap = self.device.type == "cuda" if overlap is None else bool(overlap)
        self.cuda_graphs: CudaGraphDecoder | None = None
        vocab = model.vocab_size
        self.pad_token_id = pad_token_id if pad_token_id is not None and 0 <= pad_token_id < vocab else 0
        self.cache = KVCache(
            len(model.layers),
            self.max_batch_size,
            model.num_kv_heads,
            self.max_model_len,
            model.head_dim,
            kv_cache_dtype or model.dtype,
            self.device,
        )
        n, dev = self.max_batch_size, self.device
        with torch.inference_mode():
            self._ints = torch.zeros(n, _N_INT, dtype=torch.int64, device=dev)
            self._floats = torch.ones(n, _N_FLOAT, dtype=torch.float32, device=dev)
            self._stop_tab = torch.zeros(n, 1, dtype=torch.int64, device=dev)
            self._out_tok = torch.zeros(n, self.max_model_len, dtype=torch.int64, device=dev)
            self._out_lp = torch.zeros(n, self.max_model_len, dtype=torch.float32, device=dev)
            self._out_ver = torch.zeros(n, self.max_model_len, dtype=torch.int64, device=dev)
            self._version_t = torch.tensor(int(version), dtype=torch.int64, device=dev)
            # Shared prompts (Triton attention): row r reads its first _prefix_lens[r] keys and
            # values from cache row _prefix_rows[r], the first row holding the same prompt from the
            # same admission, so a group's prompt is read from memory once per step and from the
            # L2 cache by its other rows. Fixed addresses: CUDA graphs read them at replay.
            self._prefix_rows = torch.arange(n, dtype=torch.int64, device=dev)
            self._prefix_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self._version = int(version)
        self._h_prefix_id = np.full(n, -1, dtype=np.int64)  # which admitted prompt a row holds (-1: none)
        self._h_prefix_len = np.zeros(n, dtype=np.int64)
        self._prefix_ids = 0
        self._prefix_stale = False  # rows changed since _prefix_rows / _prefix_lens were written
        # host mirrors of per-row state (numpy, vectorised; no per-token Python loops)
        self._h_ctx = np.zeros(n, dtype=np.int64)
        self._h_gen = np.zeros(n, dtype=np.int64)
        self._h_max_new = np.zeros(n, dtype=np.int64)
        self._h_min_new = np.zeros(n, dtype=np.int64)
        self._h_top_k = np.zeros(n, dtype=np.int64)
        self._h_top_p = np.ones(n, dtype=np.float64)
        self._h_temp = np.ones(n, dtype=np.float64)  # effective temperature (1.0 for greedy)
        self._h_greedy = np.zeros(n, dtype=bool)
        self._h_has_stop = np.zeros(n, dtype=bool)
        # Overlapped decode (``overlap``): a decode step's "sampled a stop token" flags are copied
        # to the host asynchronously and read only after the next step has been launched, so the
        # GPU never waits for the host between steps. _h_flag_src[r] is where row r's unread flag
        # is in the pending host buffer (-1: none); it moves with the row when rows are compacted.
        self._h_flag_src = np.full(n, -1, dtype=np.int64)
        pin = dev.type == "cuda"
        self._flag_bufs = [torch.zeros(n, dtype=torch.bool, pin_memory=pin) for _ in range(2)]
        self._flag_events = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._flag_pending = 0  # index of the buffer that _h_flag_src refers to
        self._rows: list[Sequence | None] = [None] * n
        self._active = 0  # rows 0.._active-1 hold running sequences
        self._waiting: deque[Sequence] = deque()
        self._cancelled: deque[Sequence] = deque()
        self._qlock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._stats = self._zero_stats()
        self._captures_read = 0
        self._done: list[tuple[Sequence, GenerateOutput]] = []
        if self.shape_stable_decode and self.device.type == "cuda" and CudaGraphDecoder.supported(model):
            self.cuda_graphs = CudaGraphDecoder(model, self.cache, self.max_batch_size,
                                                prefix=(self._prefix_rows, self._prefix_lens))
        self._sample_plain = sample_plain_keyed

    def compile_sampler(self) -> None:
        """Run the plain-sampling path through ``torch.compile`` (fused passes over the logits);
        a failed compilation falls back to eager PyTorch for good."""
        compiled = compile_rows_dynamic(sample_plain_keyed)  # row count symbolic, vocabulary constant

        def sample(*args):
            try:
                return compiled(*args)
            except Exception:
                log.warning("torch.compile of the sampler failed; sampling eagerly from now on", exc_info=True)
                self._sample_plain = sample_plain_keyed
                return sample_plain_keyed(*args)

        self._sample_plain = sample

    # -------------------------------------------------------------------------- state
    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = int(version)
        with torch.inference_mode():
            self._version_t.fill_(self._version)

    @property
    def num_active(self) -> int:
        return self._active

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        return self._active > 0 or bool(self._waiting) or bool(self._cancelled)

    @staticmethod
    def _zero_stats() -> dict[str, float]:
        return {"generated_tokens": 0, "prefill_tokens": 0, "shared_prefill_tokens": 0, "busy_s": 0.0, "steps": 0}

    def pop_stats(self) -> dict[str, float]:
        """Counters since the last call (reset on read) plus the current queue gauges."""
        with self._stats_lock:
            out, self._stats = self._stats, self._zero_stats()
            if self.cuda_graphs is not None:
                captures = self.cuda_graphs.captures
                out["cuda_graph_captures"] = captures - self._captures_read
                self._captures_read = captures
        out["running"] = self._active
        out["waiting"] = len(self._waiting)
        return out

    # -------------------------------------------------------------------------- requests
    def validate(self, request: GenerateRequest) -> str | None:
        """Why ``request`` cannot be served (an ``error`` message), or None if it can."""
        prompt = request.prompt_ids
        if not isinstance(request.params, SampleParams):
            return f"params must be a SampleParams, got {type(request.params).__name__}"
        if len(prompt) == 0:
            return "empty prompt: at least one prompt token is required"
        if len(prompt) >= self.max_model_len:
            return (
                f"prompt has {len(prompt)} tokens but max_model_len is {self.max_model_len}; "
                f"the prompt must leave room for at least one generated token"
            )
        vocab = self.model.vocab_size
        if set(map(type, prompt)) <= {int} and 0 <= min(prompt) and max(prompt) < vocab:
            return None  # the common case, without a Python-level loop per token
        bad = [t for t in prompt if not isinstance(t, (int, np.integer)) or not 0 <= int(t) < vocab]
        if bad:
            return f"prompt token ids out of range [0, {vocab}): {bad[:8]}"
        return None

    def make_sequence(self, request: GenerateRequest, seed: int) -> Sequence:
        """Wrap a validated request; ``seed`` is used when the request carries none."""
        p = request.params
        stop_ids: list[int] = []
        for t in ([] if p.ignore_eos else self.eos_token_ids) + list(p.stop_token_ids):
            if int(t) not in stop_ids:
                stop_ids.append(int(t))
        prompt = list(map(int, request.prompt_ids))
        k1, k2 = seed_keys(int(request.seed) if request.seed is not None else int(seed))
        max_new = min(p.max_tokens, self.max_model_len - len(prompt))
        return Sequence(request, prompt, p, k1, k2, stop_ids, max_new)

    def submit(self, seq: Sequence) -> None:
        with self._qlock:
            self._waiting.append(seq)

    def cancel(self, seq: Sequence) -> None:
        """Drop a sequence at the next step (its caller stopped waiting)."""
        seq.cancelled = True
        self._cancelled.append(seq)

    # -------------------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> list[tuple[Sequence, GenerateOutput]]:
        """Admit + prefill waiting requests, then decode one token for every active row.

        Returns the sequences that finished during the step with their outputs. With ``overlap``
        a sequence whose decode step sampled a stop token is returned by the next step (or by
        :meth:`abort_all`), with exactly the tokens up to that stop token.
        """
        t0 = time.perf_counter()
        self.cache.allocate()
        # finished outputs collect here (not in a local) so that fail_all() can still return
        # them if the step raises after some sequences finished
        done = self._done = []
        self._reap_cancelled()
        generated = self._admit(done)
        if self._active:
            generated += self._decode(done)
        self._done = []
        with self._stats_lock:
            self._stats["generated_tokens"] += generated
            self._stats["steps"] += 1
            self._stats["busy_s"] += time.perf_counter() - t0
        return done

    @torch.inference_mode()
    def abort_all(self, reason: str = "abort", error: str | None = None) -> list[tuple[Sequence, GenerateOutput]]:
        """Finish every running sequence with ``reason`` (keeping its tokens so far) and every
        waiting one with no tokens."""
        done: list[tuple[Sequence, GenerateOutput]] = []
        self._finish_pending_stops(done)  # sequences that already ended with a stop token end as such
        if self._active:
            done += self._finish(np.arange(self._active), reason=reason, error=error)
        with self._qlock:
            waiting, self._waiting = list(self._waiting), deque()
        self._cancelled.clear()
        done += [(s, GenerateOutput(finish_reason=reason, error=error)) for s in waiting if not s.cancelled]
        return done

    def fail_all(self, error: str) -> list[tuple[Sequence, GenerateOutput]]:
        """After an engine failure: end every sequence with finish "error" without touching the
        device (whose state is unknown) and reset the scheduler so new requests are served."""
        done, self._done = self._done, []
        done += [(s, GenerateOutput(finish_reason="error", error=error)) for s in self._rows[: self._active] if s]
        with self._qlock:
            waiting, self._waiting = list(self._waiting), deque()
        done += [(s, GenerateOutput(finish_reason="error", error=error)) for s in waiting]
        for s, _ in done:
            s.row = None
        self._rows = [None] * self.max_batch_size
        self._active = 0
        self._h_flag_src[:] = -1
        self._cancelled.clear()
        return done

    def _reap_cancelled(self) -> None:
        rows = []
        while self._cancelled:
            seq = self._cancelled.popleft()
            if seq.row is not None and self._rows[seq.row] is seq:
                rows.append(seq.row)
        if rows:
            self._finish(np.array(sorted(set(rows)), dtype=np.int64), reason="abort")

    # -------------------------------------------------------------------------- admission
    def _ensure_stop_width(self, width: int) -> None:
        old = self._stop_tab.shape[1]
        if width > old:  # widen, padding each row with repeats of its first entry
            extra = self._stop_tab[:, :1].expand(-1, width - old)
            self._stop_tab = torch.cat([self._stop_tab, extra], dim=1).contiguous()

    def _admit(self, done: list) -> int:
        free = self.max_batch_size - self._active
        seqs: list[Sequence] = []
        if free > 0 and self._waiting:
            with self._qlock:
                while self._waiting and len(seqs) < free:
                    seq = self._waiting.popleft()
                    if not seq.cancelled:
                        seqs.append(seq)
        if not seqs:
            return 0
        n, b0 = len(seqs), self._active
        width = max(1, self._stop_tab.shape[1], max(len(s.stop_ids) for s in seqs))
        self._ensure_stop_width(width)
        ints, floats, stops = [], [], []
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
            st = s.stop_ids or [0]
            stops.append(st + [st[0]] * (width - len(st)))
        sl = slice(b0, b0 + n)
        dev = self.device
        self._ints[sl] = torch.tensor(ints, dtype=torch.int64).to(dev, non_blocking=True)
        self._floats[sl] = torch.tensor(floats, dtype=torch.float32).to(dev, non_blocking=True)
        self._stop_tab[sl] = torch.tensor(stops, dtype=torch.int64).to(dev, non_blocking=True)
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

        # prefix sharing: one prefill per distinct prompt among the admitted requests
        groups: dict[Any, tuple[list[int], list[int]]] = {}
        for i, s in enumerate(seqs):
            key = tuple(s.prompt) if self.prefix_sharing else i
            groups.setdefault(key, (s.prompt, []))[1].append(b0 + i)
        for prompt, rows in groups.values():  # rows that may read one copy of the prompt's keys and values
            self._prefix_ids += 1
            self._h_prefix_id[rows] = self._prefix_ids
            self._h_prefix_len[rows] = len(prompt)
        self._prefix_stale = True
        uniques = sorted(groups.values(), key=lambda g: -len(g[0]))
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
        with self._stats_lock:
            self._stats["prefill_tokens"] += computed
            self._stats["shared_prefill_tokens"] += sum(len(s.prompt) for s in seqs) - computed
        rows_np = np.arange(b0, b0 + n)
        stop = self._sample_and_record(logits_rows, b0, b0 + n)
        self._finish_where_done(rows_np, stop.cpu().numpy(), done)
        return n

    # -------------------------------------------------------------------------- decode
    def _decode_shape(self, active: int, key_len: int) -> tuple[int, int]:
        """Rows and key length the decode forward runs on.

        Shape-stable mode (CUDA graphs) pads the rows to 1, 2, 4, ..., 32 and then multiples of
        32, and the key length to a multiple of 128 up to 1024, of 512 up to 4096, then a power of
        two: few distinct shapes, so few graphs, and little attention over padding. Otherwise on
        CUDA only the key length is rounded up to a multiple of 128 (some attention kernels build
        a plan per shape); on CPU shapes are exact.
        """
        if self.shape_stable_decode:
            rows = 1 << (active - 1).bit_length() if active <= 32 else -(-active // 32) * 32
            if key_len <= 1024:
                keys = -(-key_len // 128) * 128
            elif key_len <= 4096:
                keys = -(-key_len // 512) * 512
            else:
                keys = 1 << (key_len - 1).bit_length()
        else:
            rows = active
            keys = -(-key_len // 128) * 128 if self.device.type == "cuda" else key_len
        return min(rows, self.max_batch_size), min(keys, self.max_model_len)

    def reset_cuda_graphs(self) -> None:
        """Forget captured graphs (after the KV cache or the weights were reallocated)."""
        if self.cuda_graphs is not None:
            self.cuda_graphs.reset()

    def _decode(self, done: list) -> int:
        b = self._active
        key_len = int(self._h_ctx[:b].max()) + 1
        rows, key_len = self._decode_shape(b, key_len)
        tokens = self._ints[:rows, _TOK]
        positions = self._ints[:rows, _CTX]
        if rows > b:  # padding rows are free rows: keep their (stale) state in range
            positions = positions.clamp(max=key_len - 1)
        prefix = None
        if self.model.triton_attention:
            if self._prefix_stale:
                self._write_prefix_rows(b)
            prefix = (self._prefix_rows[:rows], self._prefix_lens[:rows])
        if self.cuda_graphs is not None:
            try:
                logits = self.cuda_graphs(tokens, positions, key_len)[:b]
            except Exception:  # capture is an optimisation: fall back to eager for good
                log.warning("CUDA graph capture failed; decoding without CUDA graphs", exc_info=True)
                self.cuda_graphs = None
                logits = self.model.decode(tokens, positions, self.cache, key_len, prefix=prefix)[:b]
        else:
            logits = self.model.decode(tokens, positions, self.cache, key_len, prefix=prefix)[:b]
        self._ints[:b, _CTX] += 1
        self._h_ctx[:b] += 1
        rows_np = np.arange(b)
        stop = self._sample_and_record(logits, 0, b)
        if not self.overlap:
            self._finish_where_done(rows_np, stop.cpu().numpy(), done)
            return b
        # Issue this step's flags, then read the previous step's (by now computed, or nearly):
        # the GPU already has this step queued while the host finishes rows and prepares the
        # next one. A row that sampled a stop token in the previous step has been decoded once
        # more in this one; that token is dropped (its length goes back by one).
        previous = self._h_flag_src[:b].copy()
        self._h_flag_src[:b] = rows_np
        old = self._issue_flags(stop)
        stopped = self._read_flags(old, previous)
        extra = int(stopped.sum())
        self._h_gen[:b] -= stopped
        self._finish_where_done(rows_np, stopped, done)
        return b - extra

    def _write_prefix_rows(self, b: int) -> None:
        """Point each active row at the first active row holding the same admitted prompt (itself
        when it is the first). Any row of the group would do: each holds its own copy of the
        prompt's keys and values, written once at admission and never changed by decoding."""
        ids = self._h_prefix_id[:b]
        _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
        src = first[inverse.reshape(-1)]
        src = np.where(ids >= 0, src, np.arange(b))
        lens = np.where(ids >= 0, self._h_prefix_len[:b], 0)
        self._prefix_rows[:b].copy_(torch.from_numpy(src.astype(np.int64)), non_blocking=True)
        self._prefix_lens[:b].copy_(torch.from_numpy(lens.astype(np.int32)), non_blocking=True)
        self._prefix_stale = False

    def _issue_flags(self, stop: torch.Tensor) -> int:
        """Start copying ``stop`` (device bools, rows ``0..len-1``) into the free host buffer, make
        it the pending one, and return the index of the buffer pending before."""
        old, new = self._flag_pending, 1 - self._flag_pending
        self._flag_bufs[new][: stop.shape[0]].copy_(stop, non_blocking=True)
        if self._flag_events[new] is not None:
            self._flag_events[new].record()
        self._flag_pending = new
        return old

    def _read_flags(self, buf: int, src: np.ndarray) -> np.ndarray:
        """Host bools: the flag at ``src[i]`` of buffer ``buf`` (False where ``src[i] < 0``)."""
        out = np.zeros(len(src), dtype=bool)
        have = src >= 0
        if have.any():
            if self._flag_events[buf] is not None:
                self._flag_events[buf].synchronize()
            out[have] = self._flag_bufs[buf].numpy()[src[have]]
        return out

    def _finish_pending_stops(self, done: list) -> None:
        """Finish the rows whose last decode step sampled a stop token not read yet (before
        anything else ends the running rows)."""
        b = self._active
        if b == 0:
            return
        stopped = self._read_flags(self._flag_pending, self._h_flag_src[:b])
        self._h_flag_src[:b] = -1
        if stopped.any():
            done += self._finish(np.arange(b)[stopped])

    # -------------------------------------------------------------------------- sampling
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

    # -------------------------------------------------------------------------- finishing
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
                lps = self._out_lp[idx, :longest].cpu().tolist()
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
                out.append((seq, GenerateOutput(tokens, lps[i][:g], vers[i][:g], why, error)))
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


# ------------------------------------------------------------------------------------------
# Backend component
# ------------------------------------------------------------------------------------------
_STEPS_SLICE_S = 0.02  # the longest run of engine steps between two visits to the event loop


def _release_cuda_workspaces() -> None:
    """Return cached CUDA memory to the driver, including cuBLAS workspaces (re-created on the
    next matrix product), so a colocated trainer can use it."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        try:
            clear()
        except RuntimeError:  # private API: never let it break sleep()
            log.debug("could not clear cuBLAS workspaces", exc_info=True)
    torch.cuda.empty_cache()


def _set_result_if_pending(fut: asyncio.Future, out: GenerateOutput) -> None:
    if not fut.done():
        fut.set_result(out)


class EmbeddedBackend(InferenceBackend):
    """Built-in continuous-batching engine in pure PyTorch (llama, mistral, qwen2, qwen3 models).

    Implements the :mod:`rlcli.backends.base` contract on top of :class:`EmbeddedEngine`.
    ``generate`` enqueues a request and awaits its future; a driver task, started lazily on the
    running event loop, runs engine steps one after another in a dedicated worker thread while
    there is work, so the loop stays responsive. One lock serialises steps with
    ``update_weights``, ``sleep``, ``wake_up`` and ``shutdown``. Requests without a ``seed`` get
    one from a counter seeded by ``ctx.seed`` (and ``ctx.rank``).
    """

    name: ClassVar[str] = "embedded"

    class Config(ComponentConfig):
        max_batch_size: int = Field(
            256, gt=0, description="Sequences decoded together: the number of KV-cache rows preallocated."
        )
        max_model_len: int | None = Field(
            None,
            gt=1,
            description="Prompt + response tokens per sequence (KV-cache length). Default: "
            "min(model max_position_embeddings, 4096). Longer prompts fail with finish_reason "
            "'error'; responses are cut at this length with finish_reason 'length'.",
        )
        max_prefill_tokens: int = Field(
            16384,
            gt=0,
            description="Padded prompt tokens per prefill forward pass; a single longer prompt is prefilled alone.",
        )
        prefix_sharing: bool = Field(
            True,
            description="Prefill identical prompts admitted together (a group's prompt_repeat_k copies) "
            "once and copy their KV cache.",
        )
        cuda_graphs: bool = Field(
            True,
            description="On CUDA, pad decode steps to bucketed shapes (rows, key length) and replay a CUDA graph "
            "captured per shape, removing the kernel-launch overhead of small models. Ignored on CPU.",
        )
        kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
            "auto", description="KV-cache dtype; auto = the model dtype."
        )
        attention: Literal["auto", "sdpa", "triton"] = Field(
            "auto",
            description="Decode attention: 'triton' = rlcli's Triton kernel (each row reads its own keys once per "
            "query-head group; needs CUDA, the triton package and a KV cache in the model dtype), 'sdpa' = PyTorch "
            "scaled_dot_product_attention with a mask over the padded key length, 'auto' = triton where it can run, "
            "else sdpa.",
        )
        compile: bool | None = Field(
            None,
            description="torch.compile each decoder layer's decode step and the sampler (fuses their small "
            "operations; the first step pays a compilation of some seconds; a failed compilation falls back to "
            "eager PyTorch with a warning). Default (null): on for CUDA, off on CPU.",
        )

    def __init__(self, config: "EmbeddedBackend.Config | None", ctx: BackendContext):
        super().__init__(config, ctx)
        cfg = self.config
        self._device = torch.device(ctx.device)
        self._graphs_cache_address: int | None = None  # the KV cache's address when sleep(1) kept the graphs
        hf_model = self._load_model(ctx)
        self._model = LlamaFamilyModel(hf_model)
        max_len = cfg.max_model_len or min(self._model.max_position_embeddings, 4096)
        if max_len > self._model.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_len} exceeds the model's max_position_embeddings="
                f"{self._model.max_position_embeddings}"
            )
        kv_dtype = None if cfg.kv_cache_dtype == "auto" else _DTYPES[cfg.kv_cache_dtype]
        self._engine = EmbeddedEngine(
            self._model,
            max_batch_size=cfg.max_batch_size,
            max_model_len=max_len,
            max_prefill_tokens=cfg.max_prefill_tokens,
            eos_token_ids=ctx.eos_token_ids,
            prefix_sharing=cfg.prefix_sharing,
            kv_cache_dtype=kv_dtype,
            pad_token_id=ctx.pad_token_id,
            version=ctx.version,
            shape_stable_decode=cfg.cuda_graphs and self._device.type == "cuda",
        )
        kv_matches = kv_dtype is None or kv_dtype == self._model.dtype
        if cfg.attention == "triton" or (
            cfg.attention == "auto" and self._device.type == "cuda" and kv_matches
            and triton_decode_attention_available(self._device)
        ):
            if not kv_matches:
                raise ValueError(f"attention 'triton' needs kv_cache_dtype 'auto' or the model dtype "
                                 f"({self._model.dtype}), got {cfg.kv_cache_dtype!r}")
            self._model.use_triton_attention()
        if cfg.compile if cfg.compile is not None else self._device.type == "cuda":
            self._model.compile_decode()
            self._engine.compile_sampler()
        self._lock = threading.Lock()
        self._paused = False
        self._asleep = 0
        #: sleep(1) keeps the KV cache: on the CPU it is host memory either way, and allocating it again
        #: at each wake-up is a full zero-fill (5 % of a toy recipe's step)
        self.keeps_cache_asleep = self._device.type == "cpu"
        self._closed = False
        self._driver: asyncio.Task | None = None
        self._driver_loop: asyncio.AbstractEventLoop | None = None
        # One dedicated worker thread runs every step: torch's intra-op thread pool is per
        # calling thread, and hopping between the loop's default executor threads would start
        # competing pools (several times slower on a small CPU).
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlcli-embedded")
        self._seed_base = _splitmix64((int(ctx.seed) << 20) ^ (int(ctx.rank) & 0xFFFFF))
        self._seed_counter = 0

    @staticmethod
    def _load_model(ctx: BackendContext) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM  # heavy import, only when a backend is built

        model = AutoModelForCausalLM.from_pretrained(str(ctx.model_dir), dtype=ctx.dtype)
        model.to(ctx.device)
        model.eval()
        model.requires_grad_(False)
        return model

    # -------------------------------------------------------------------------- properties
    @property
    def version(self) -> int:
        return self._engine.version

    @property
    def engine(self) -> EmbeddedEngine:
        """The synchronous scheduler (for inspection and benchmarks)."""
        return self._engine

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def paused(self) -> bool:
        return self._paused

    # -------------------------------------------------------------------------- generate
    def _next_seed(self) -> int:
        self._seed_counter += 1
        return _splitmix64(self._seed_base + self._seed_counter)

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Generate a response; see :mod:`rlcli.backends.base` for the contract.

        Invalid requests (empty prompt, token ids outside the vocabulary, prompt not shorter
        than ``max_model_len``) return ``finish_reason="error"`` with the reason in ``error``.
        """
        if self._closed:
            return GenerateOutput(finish_reason="error", error="the embedded backend is shut down")
        problem = self._engine.validate(request)
        if problem is not None:
            return GenerateOutput(finish_reason="error", error=problem)
        if self._paused:
            return GenerateOutput(finish_reason="abort")
        loop = asyncio.get_running_loop()
        seq = self._engine.make_sequence(request, self._next_seed())
        seq.future = loop.create_future()
        self._engine.submit(seq)
        self._ensure_driver(loop)
        try:
            return await seq.future
        except asyncio.CancelledError:
            self._engine.cancel(seq)
            raise

    def _ensure_driver(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._driver is None or self._driver.done() or self._driver_loop is not loop:
            self._driver_loop = loop
            self._driver = loop.create_task(self._drive(), name="rlcli-embedded-engine")

    def _kick(self) -> None:
        """Restart the driver (e.g. after wake_up) if requests are queued."""
        loop = self._driver_loop
        if loop is None or loop.is_closed() or not self._engine.has_work():
            return
        try:
            loop.call_soon_threadsafe(self._ensure_driver, loop)
        except RuntimeError:  # loop closed meanwhile
            pass

    async def _drive(self) -> None:
        """Run engine steps in the worker thread while there is work (the event loop stays free)."""
        loop = asyncio.get_running_loop()
        while not self._closed and self._engine.has_work() and (not self._asleep or self._paused):
            try:
                done = await loop.run_in_executor(self._executor, self._locked_steps)
            except Exception as exc:  # never let a failed step strand the callers
                log.exception("embedded engine step failed")
                with self._lock:
                    done = self._engine.fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
            self._deliver(done)

    def _locked_steps(self) -> list[tuple[Sequence, GenerateOutput]]:
        """Engine steps back to back (in the worker thread) until a sequence finishes, the work
        runs out, the backend is paused, asleep or closed, or ``_STEPS_SLICE_S`` has passed. Each
        round trip between the event loop and the worker thread costs a few hundred microseconds
        with the GPU idle, so one per decode step would add up; requests submitted meanwhile are
        admitted by the next step, and each step takes the lock on its own, so ``sleep`` or
        ``update_weights`` wait for at most one step plus the slice."""
        deadline = time.perf_counter() + _STEPS_SLICE_S
        while True:
            done = self._locked_step()
            if (done or self._closed or self._paused or self._asleep or not self._engine.has_work()
                    or time.perf_counter() >= deadline):
                return done

    def _locked_step(self) -> list[tuple[Sequence, GenerateOutput]]:
        with self._lock:
            if self._closed or self._paused:
                return self._engine.abort_all()
            if self._asleep:
                return []
            return self._engine.step()

    @staticmethod
    def _deliver(done: list[tuple[Sequence, GenerateOutput]]) -> None:
        """Resolve the futures of finished sequences, from any thread."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        for seq, out in done:
            fut = seq.future
            if fut is None or fut.done():
                continue
            loop = fut.get_loop()
            if loop is running:
                fut.set_result(out)
            else:
                try:
                    loop.call_soon_threadsafe(_set_result_if_pending, fut, out)
                except RuntimeError:  # its loop is closed: nobody is waiting any more
                    pass

    # -------------------------------------------------------------------------- control
    def pause(self) -> None:
        """Abort every in-flight request (finish "abort", tokens so far) and refuse new ones.

        If no step is running the requests are aborted at once, else at the end of that step.
        """
        self._paused = True
        if self._lock.acquire(blocking=False):
            try:
                done = self._engine.abort_all()
            finally:
                self._lock.release()
            self._deliver(done)

    def resume(self) -> None:
        """Accept requests again after :meth:`pause`."""
        self._paused = False

    accepts_live_weights: ClassVar[bool] = True  # update_weights copies (and casts) before it returns

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy Hugging Face-named tensors into the model in place and set the policy version.

        Any subset of ``model.state_dict()`` names is accepted (``lm_head.weight`` of a tied
        model updates the shared embedding); tensors are cast to the engine's dtype and device.
        Unknown names or wrong shapes raise ``ValueError`` before anything is changed. Waits for
        a running step to end; tokens generated afterwards carry ``version``.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("the embedded backend is shut down")
            self._model.load_named_tensors(named_tensors)
            if self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
            self._engine.set_version(version)

    def sleep(self, level: int = 1) -> None:
        """Release device memory: the KV cache (level 1; kept on the CPU, where it is host memory
        anyway) and also the weights (level 2, moved to CPU memory). Requests still in flight are aborted; requests made while asleep wait for
        :meth:`wake_up`. On CPU the weights stay where they are. Level 1 leaves the freed memory
        in PyTorch's caching allocator, where a trainer in the same process reuses it at no cost,
        and keeps the captured decode graphs (their memory pool stays allocated);
        level 2 also drops the graphs and returns cached memory to the driver (for other processes)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        with self._lock:
            done = self._engine.abort_all()
            if level == 2:  # the weights move: every captured graph is stale
                self._engine.reset_cuda_graphs()
            else:  # kept while the cache comes back at the same address (see wake_up)
                self._graphs_cache_address = self._engine.cache.address
            if not self.keeps_cache_asleep or level == 2:
                self._engine.cache.free()
            if level == 2 and self._device.type == "cuda":
                self._model.to("cpu")
            if self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
                if level == 2:  # level 1 leaves freed memory in torch's cache, where a colocated trainer reuses it
                    _release_cuda_workspaces()
            self._asleep = max(self._asleep, level)
        self._deliver(done)

    def wake_up(self) -> None:
        """Restore what :meth:`sleep` released and resume serving queued requests."""
        with self._lock:
            if self._asleep >= 2 and self._device.type == "cuda":
                self._model.to(self._device)
            self._engine.cache.allocate()
            # The decode graphs hold the cache's address: they stay valid if the cache came back
            # there (PyTorch's allocator hands out the same block when what a colocated trainer
            # allocated meanwhile has been freed; not guaranteed, hence the check), which saves
            # re-capturing every graph in every rollout.
            if self._asleep and self._engine.cache.address != self._graphs_cache_address:
                self._engine.reset_cuda_graphs()
            self._graphs_cache_address = None
            self._asleep = 0
        self._kick()

    def shutdown(self) -> None:
        """Abort everything in flight and free the cache and the model."""
        with self._lock:
            if self._closed:
                return
            done = self._engine.abort_all()
            self._engine.reset_cuda_graphs()
            self._engine.cuda_graphs = None
            self._engine.cache.free()
            self._closed = True
            # drop every reference to the weights so their memory can be reclaimed
            self._engine.model = None
            self._model = None
            if self._device.type == "cuda":
                _release_cuda_workspaces()
        self._executor.shutdown(wait=False)
        self._deliver(done)

    def stats(self) -> dict[str, float]:
        """``generated_tokens``, ``prefill_tokens`` (computed, i.e. after prefix sharing),
        ``shared_prefill_tokens``, ``busy_s``, ``steps`` and, with CUDA graphs,
        ``cuda_graph_captures`` since the last call (reset on read), plus the gauges ``running``
        and ``waiting``."""
        return self._engine.pop_stats()
