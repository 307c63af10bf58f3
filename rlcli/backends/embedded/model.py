"""The embedded engine's model: batched prefill and decode over a Hugging Face llama-family model.

:class:`LlamaFamilyModel` reuses the Hugging Face model's own modules (embedding, q/k/v/o
projections, RMSNorms, q/k norms, MLP, lm_head and the model's ``rotary_emb``, so every RoPE
scaling variant stays correct) and replaces only attention and the KV cache
(:class:`~rlcli.backends.embedded.kv_cache.KVCache`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F

from rlcli.backends.decode_attention import decode_attention_op, triton_decode_attention_available
from rlcli.backends.embedded.attention import _attention_backends, decode_mask, sdpa_decode_attention
from rlcli.backends.embedded.kv_cache import KVCache
from rlcli.compiling import compile_rows_dynamic

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
"""Hugging Face ``model_type`` values the embedded engine can run."""


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
        cache: KVCache,
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
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, key_len: int, allow_cudnn: bool = False,
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

    def _decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, key_len: int,
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
