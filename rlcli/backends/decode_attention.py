"""Decode attention in Triton: one new query token per row against a slotted KV cache.

What it computes
    For every row ``i`` (one sequence being decoded) and query head ``h``::

        out[i, h] = softmax_j(scale * q[i, h] . k_cache[i, h // group, j]) @ v_cache[i, h // group, j]

    over the cache positions ``j`` with ``j <= positions[i]``, ``j < key_len`` and, with a
    sliding ``window``, ``j > positions[i] - window``. This is exactly what
    ``LlamaFamilyModel._decode_layer`` in :mod:`rlcli.backends.embedded.model` gets from
    ``F.scaled_dot_product_attention(q.view(n, KVH, group, hd), keys, values, attn_mask=mask)``
    with the boolean mask it builds in ``_decode``. Softmax and accumulation are in float32;
    the result has the dtype of ``q``. Optionally (``prefix_rows``, ``prefix_lens``) row ``i``
    reads the keys and values of its positions below ``prefix_lens[i]`` from cache row
    ``prefix_rows[i]``: the samples of one prompt then read one copy of the prompt (once from
    memory, then from the L2 cache), with the same result.

Layout
    ``q``: ``[n, H, hd]``; ``k_cache`` / ``v_cache``: ``[R, KVH, Lmax, hd]`` with ``R >= n`` (row
    ``i`` of ``q`` reads cache row ``i``; the cache may be a view of a bigger buffer, strided in
    dimension 0, with a unit stride in the last dimension); ``positions``: integer ``[n]`` on the
    device, the position of each row's new token, whose key and value are already in the cache.
    Grouped-query attention: ``H = KVH * group`` and query head ``h`` uses KV head ``h // group``.

Why
    Decode attention is bound by memory bandwidth: each step reads every visible key and value
    once and does two tiny matrix-vector products with them. The SDPA formulation reads the
    whole ``[:n, :, :key_len]`` slab of the cache plus the mask (``key_len`` is a padded bucket,
    usually well past most rows' positions), and its kernels are built for long query blocks. Here one program
    handles one ``(row, kv_head)`` pair and *all* the ``group`` query heads that share that KV
    head (padded to at least 16 rows so ``tl.dot`` applies), so each key and value is read from
    memory once per group, and only up to the row's own position (and from the start of its
    window): a row at position 70 in a 384-key bucket reads 71 keys, not 384.

Kernel design (flash-decoding)
    * ``_attn_fwd`` - grid ``(n * KVH, num_splits)``. A program loads the row's position, takes
      the visible range ``[start, end)`` (``end = min(pos + 1, key_len)``, ``start`` from the
      window), splits its ``BLOCK_N``-aligned blocks evenly into ``num_splits`` contiguous
      chunks and walks its own chunk with an online softmax (``exp2`` with ``log2(e)`` folded
      into the scale). With one split it normalises and writes the output directly.
    * ``_combine`` - only when ``num_splits > 1``: grid ``(n * H,)``; merges the per-split
      partial outputs with their log-sum-exps. The partials live in float32 scratch tensors
      whose shapes depend only on ``n``, ``H``, ``hd`` and ``num_splits``.
    * The number of splits is chosen on the host from shapes only (:func:`choose_num_splits`):
      1 when ``n * KVH`` programs already fill the GPU (``PROGRAMS_PER_SM`` per SM), otherwise
      enough splits to get there while keeping at least ``MIN_KEYS_PER_SPLIT`` keys of
      ``key_len`` per split (so 1-8 rows with a 4k context still spread over the whole chip).

Everything a call does is a function of the tensors' shapes and ``key_len`` - no host/device
synchronisation, no data-dependent allocation - so it can be captured in a CUDA graph (build
the kernels once, e.g. by one eager call, before capturing). Rows whose visible range is empty
(only possible when ``positions[i] >= key_len`` with a window) get zeros.

The Triton kernels are defined lazily (:func:`_kernels`, once per interpret mode), because
``triton.jit`` decides at decoration time whether to compile or to interpret; importing this
module never needs Triton. Triton's interpreter (``TRITON_INTERPRET=1``, which runs the kernels
on CPU tensors, as the tests do) must be switched on before Triton is first imported, since
Triton's own helpers (``tl.cdiv``) are decorated then. Under the interpreter the key loop is a
``while`` loop and ``tl.dot`` operands are upcast to float32 (its ``range`` rejects loaded
bounds with NumPy 2, and its ``tl.dot`` mishandles bfloat16); the compiled kernel is otherwise
the same code.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace
from typing import NamedTuple

import torch

__all__ = ["triton_decode_attention_available", "decode_attention", "choose_num_splits"]

#: Keys per block of the inner loop for 16-bit inputs with head dims up to 128 (halved for
#: float32 and for larger head dims, to bound registers and shared memory).
BLOCK_N = 64
#: A split of the key axis covers at least this many keys of ``key_len``.
MIN_KEYS_PER_SPLIT = 256
#: Upper bound on the number of splits.
MAX_SPLITS = 64
#: Programs per SM the split rule aims for: several resident programs per SM are what keeps
#: enough loads in flight to approach the memory bandwidth.
PROGRAMS_PER_SM = 4
#: SM count assumed when there is no CUDA device (interpreter runs): an H100/H200.
DEFAULT_SM_COUNT = 132

_LOG2E = 1.4426950408889634
#: Sliding window passed to the kernel when there is none (``pos - window + 1`` stays negative).
_NO_WINDOW = 1 << 30


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_decode_attention_available(device: torch.device | str) -> bool:
    """Whether :func:`decode_attention` can run for tensors on ``device``: Triton imports and
    either ``device`` is a CUDA device or ``TRITON_INTERPRET=1`` (Triton's CPU interpreter).
    Never raises."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401

        return torch.device(device).type == "cuda" or _interpreting()
    except Exception:
        return False


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda" or not torch.cuda.is_available():
        return DEFAULT_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_num_splits(n: int, kv_heads: int, key_len: int, sm_count: int = DEFAULT_SM_COUNT) -> int:
    """How many chunks the key axis is split into, from shapes only.

    One split when the ``n * kv_heads`` programs already give ``PROGRAMS_PER_SM`` programs per
    SM (large batches: the split-K reduction would only add traffic). Otherwise enough splits
    to reach that, but never fewer than ``MIN_KEYS_PER_SPLIT`` keys of ``key_len`` per split nor
    more than ``MAX_SPLITS`` splits. E.g. on 132 SMs: 512 rows x 2 KV heads -> 1; 8 rows x 2 KV
    heads with ``key_len`` 4096 -> 16.
    """
    programs = n * kv_heads
    if programs <= 0 or programs >= PROGRAMS_PER_SM * sm_count:
        return 1
    by_length = key_len // MIN_KEYS_PER_SPLIT
    wanted = -(-PROGRAMS_PER_SM * sm_count // programs)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    """Build the Triton kernels (once per interpret mode: ``triton.jit`` reads
    ``TRITON_INTERPRET`` when it decorates, and the caller keys this cache on it)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _attend_block(q, k_head, v_head, row, src, plen, block, start, end, m_i, l_i, acc, offs_n, offs_d, d_mask,
                      stride_kr, stride_kl, stride_vr, stride_vl, qk_scale, HAS_PREFIX: tl.constexpr,
                      PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
        """Online-softmax update of (m_i, l_i, acc) with the keys ``block .. block + BLOCK_N - 1``
        (those outside ``[start, end)`` are masked and not read). With HAS_PREFIX, keys below
        ``plen`` are read from cache row ``src``, the others from ``row``."""
        cols = block + offs_n
        valid = (cols >= start) & (cols < end)
        kv_mask = valid[:, None] & d_mask[None, :]
        if HAS_PREFIX:
            key_row = tl.where(cols < plen, src, row)  # [BLOCK_N] int64
            k_ptrs = k_head + key_row[:, None] * stride_kr + cols[:, None] * stride_kl + offs_d[None, :]
            v_ptrs = v_head + key_row[:, None] * stride_vr + cols[:, None] * stride_vl + offs_d[None, :]
        else:
            k_ptrs = k_head + row * stride_kr + cols[:, None] * stride_kl + offs_d[None, :]
            v_ptrs = v_head + row * stride_vr + cols[:, None] * stride_vl + offs_d[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        if INTERPRET:  # the interpreter's tl.dot multiplies bfloat16 bit patterns as integers
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N], log2 units
        s = tl.where(valid[None, :], s, float("-inf"))
        # Every block visited holds at least one visible key, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        p = p.to(v.dtype)  # probabilities in the input dtype for the tensor-core product, as SDPA does
        if INTERPRET:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit(do_not_specialize=["key_len", "window"])
    def _attn_fwd(
        Q, K, V, Pos, PrefixRow, PrefixLen, Out, Lse,
        stride_qn, stride_qh,
        stride_kr, stride_kh, stride_kl,
        stride_vr, stride_vh, stride_vl,
        stride_on, stride_oh, stride_os,
        key_len, window, qk_scale,
        KVH: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
        ATTEND_BLOCK: tl.constexpr, HAS_PREFIX: tl.constexpr,
    ):
        """One (row, kv head, split): all GROUP query heads against the split's keys.

        With NUM_SPLITS == 1 writes the normalised output into Out [n, H, hd]; otherwise writes
        the split's normalised partial output into Out [n, H, NUM_SPLITS, hd] (float32) and its
        log2-sum-exp into Lse [n, H, NUM_SPLITS] (-inf for an empty split). ATTEND_BLOCK is
        ``_attend_block``, passed as an argument because the interpreter does not see closures.
        With HAS_PREFIX the row's keys below PrefixLen[row] are read from cache row PrefixRow[row].
        """
        pid = tl.program_id(0)
        split = tl.program_id(1)
        row = pid // KVH
        kvh = pid % KVH
        row64 = row.to(tl.int64)

        pos = tl.load(Pos + row).to(tl.int32)
        end = tl.minimum(pos + 1, key_len)
        start = tl.maximum(pos - window + 1, 0)
        # This split's share of the BLOCK_N-aligned blocks covering [start, end).
        first = (start // BLOCK_N) * BLOCK_N
        n_blocks = tl.where(end > start, tl.cdiv(end - first, BLOCK_N), 0)  # no block when nothing is visible
        per_split = tl.cdiv(n_blocks, NUM_SPLITS)
        lo = first + split * per_split * BLOCK_N
        hi = tl.minimum(lo + per_split * BLOCK_N, end)

        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        heads = kvh * GROUP + offs_g

        q_ptrs = Q + row64 * stride_qn + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        if INTERPRET:
            q = q.to(tl.float32)
        k_head = K + kvh * stride_kh
        v_head = V + kvh * stride_vh
        if HAS_PREFIX:
            src = tl.load(PrefixRow + row).to(tl.int64)
            plen = tl.load(PrefixLen + row).to(tl.int32)
        else:
            src = row64
            plen = 0

        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        if INTERPRET:
            # Triton's interpreter turns a loaded scalar into a 1-element array that NumPy 2
            # refuses as a range() bound; a while loop visits the same blocks.
            block = lo
            while block < hi:
                m_i, l_i, acc = ATTEND_BLOCK(q, k_head, v_head, row64, src, plen, block, start, end, m_i, l_i, acc,
                                              offs_n, offs_d, d_mask, stride_kr, stride_kl, stride_vr, stride_vl,
                                              qk_scale, HAS_PREFIX, PRECISION, INTERPRET)
                block += BLOCK_N
        else:
            for block in range(lo, hi, BLOCK_N):
                m_i, l_i, acc = ATTEND_BLOCK(q, k_head, v_head, row64, src, plen, block, start, end, m_i, l_i, acc,
                                              offs_n, offs_d, d_mask, stride_kr, stride_kl, stride_vr, stride_vl,
                                              qk_scale, HAS_PREFIX, PRECISION, INTERPRET)

        nonempty = l_i > 0.0
        out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        out_mask = g_mask[:, None] & d_mask[None, :]
        o_ptrs = Out + row64 * stride_on + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
        if NUM_SPLITS == 1:
            tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=out_mask)
        else:
            tl.store(o_ptrs, out, mask=out_mask)
            lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
            lse_ptrs = Lse + (row64 * (KVH * GROUP) + heads) * NUM_SPLITS + split
            tl.store(lse_ptrs, lse, mask=g_mask)

    @triton.jit
    def _combine(
        Part, Lse, Out,
        stride_on, stride_oh,
        H: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """One (row, query head): merge the NUM_SPLITS partial outputs weighted by their sum-exps."""
        pid = tl.program_id(0).to(tl.int64)
        row = pid // H
        head = pid % H
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_mask = offs_s < NUM_SPLITS
        d_mask = offs_d < HEAD_DIM
        lse = tl.load(Lse + pid * NUM_SPLITS + offs_s, mask=s_mask, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)  # every split empty: all weights become 0
        w = tl.exp2(lse - m)
        denom = tl.sum(w, 0)
        part_ptrs = Part + (pid * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :]
        part = tl.load(part_ptrs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        out = tl.sum(part * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
        tl.store(Out + row * stride_on + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)

    return SimpleNamespace(attend_block=_attend_block, attn_fwd=_attn_fwd, combine=_combine)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    key_len: int,
    scale: float,
    window: int | None = None,
    *,
    prefix_rows: torch.Tensor | None = None,
    prefix_lens: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per row over a slotted KV cache; returns ``[n, H, hd]`` in ``q``'s dtype.

    ``q`` ``[n, H, hd]``; ``k_cache``, ``v_cache`` ``[R, KVH, Lmax, hd]`` (``R >= n``, same dtype
    as ``q``, unit stride in the last dimension); ``positions`` integer ``[n]`` on the same
    device. Row ``i`` attends to cache positions ``j`` of cache row ``i`` with
    ``j <= positions[i]``, ``j < key_len`` and, if ``window`` is given,
    ``j > positions[i] - window``; query head ``h`` uses KV head ``h // (H // KVH)``.

    ``prefix_rows``, ``prefix_lens`` (integer ``[n]``, both or neither): row ``i`` reads its keys
    and values at positions ``j < prefix_lens[i]`` from cache row ``prefix_rows[i]`` instead of
    its own (the rows of one prompt's samples all point at one of them, whose copy of the
    prompt's keys and values is then read from memory once and from the L2 cache by the
    others). Every such row must hold exactly what row ``i`` would hold there, and every entry
    of ``prefix_rows`` must be a row of the cache; neither is checked (that would need a device
    synchronisation). The result is then exactly the one without them.

    The other keyword-only arguments are tuning knobs (the defaults are what the engine should use):
    ``num_splits`` forces the split of the key axis (default :func:`choose_num_splits`),
    ``block_n`` the keys per inner block (a power of two >= 16), ``num_warps`` / ``num_stages``
    the Triton launch parameters of the main kernel (``num_stages`` is the depth of the
    software pipeline of the key loop). Defaults: with one split, 16-bit inputs and head dims
    up to 64 (many rows, e.g. a rollout batch), 2 warps and 2 stages, which keep more programs
    resident per SM - on the H200, 512 rows at positions 64-320: 15.7 us against 17.4 us with
    4 warps and 3 stages (``benchmarks/decode_attention.py --sweep``, 2026-12-02); otherwise 4
    warps, and 3 stages for 16-bit inputs with head dims up to 64, 2 for the rest.
    """
    q, positions, prefix_rows, prefix_lens = _checked_inputs(q, k_cache, v_cache, positions, key_len, window,
                                                             prefix_rows, prefix_lens)
    n, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    out = torch.empty((n, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    launch = _launch_params(q, kv_heads, key_len, block_n, num_splits, num_warps, num_stages)
    _launch(q, k_cache, v_cache, positions, prefix_rows, prefix_lens, out, key_len, scale, window, launch)
    return out


def _checked_inputs(q, k_cache, v_cache, positions, key_len, window, prefix_rows, prefix_lens):
    """:func:`decode_attention`'s checks of its tensors; returns ``q``, ``positions``,
    ``prefix_rows`` and ``prefix_lens`` in the layout the kernel reads (a copy only where needed)."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"expected q [n, H, hd] and caches [R, KVH, Lmax, hd], got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    n, num_heads, head_dim = q.shape
    rows, kv_heads, max_len, cache_hd = k_cache.shape
    if cache_hd != head_dim or num_heads % kv_heads or rows < n:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)} and caches {tuple(k_cache.shape)}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported dtype {q.dtype}")
    if positions.shape != (n,):
        raise ValueError(f"positions must have shape ({n},), got {tuple(positions.shape)}")
    if (prefix_rows is None) != (prefix_lens is None):
        raise ValueError("prefix_rows and prefix_lens go together: give both or neither")
    if prefix_rows is not None:
        for name, t in (("prefix_rows", prefix_rows), ("prefix_lens", prefix_lens)):
            if t.shape != (n,) or t.dtype not in (torch.int32, torch.int64) or t.device != q.device:
                raise ValueError(f"{name} must be an integer tensor of shape ({n},) on {q.device}, got "
                                 f"{t.dtype} {tuple(t.shape)} on {t.device}")
        prefix_rows, prefix_lens = prefix_rows.contiguous(), prefix_lens.contiguous()
    if not 0 < key_len <= max_len:
        raise ValueError(f"key_len must be in 1..{max_len}, got {key_len}")
    if window is not None and window < 1:
        raise ValueError(f"window must be positive, got {window}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a unit stride in their last dimension")
    if q.stride(-1) != 1:
        q = q.contiguous()
    positions = positions.contiguous()  # no copy when it already is
    return q, positions, prefix_rows, prefix_lens


class _LaunchParams(NamedTuple):
    block_d: int  # head dim padded to a power of two >= 16
    block_g: int  # query heads per KV head, likewise padded
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int


def _launch_params(q, kv_heads, key_len, block_n, num_splits, num_warps, num_stages) -> _LaunchParams:
    """Block sizes and launch parameters from the shapes and dtype: the knobs given, defaults for the
    rest (see :func:`decode_attention`)."""
    n, num_heads, head_dim = q.shape
    block_d = max(16, _next_pow2(head_dim))
    block_g = max(16, _next_pow2(num_heads // kv_heads))
    wide = q.dtype == torch.float32 or block_d > 128
    if block_n is None:
        block_n = BLOCK_N // 2 if wide else BLOCK_N
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if num_splits is None:
        num_splits = choose_num_splits(n, kv_heads, key_len, _sm_count(q.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be positive, got {num_splits}")
    many_rows = num_splits == 1 and not wide and block_d <= 64
    if num_warps is None:
        num_warps = 2 if many_rows else 4
    if num_stages is None:
        num_stages = 2 if many_rows or wide or block_d > 64 else 3
    return _LaunchParams(block_d, block_g, block_n, num_splits, num_warps, num_stages)


def _launch(q, k_cache, v_cache, positions, prefix_rows, prefix_lens, out, key_len, scale, window,
            p: _LaunchParams) -> None:
    """Run ``_attn_fwd`` into ``out`` (with one split) or into float32 partials merged by ``_combine``."""
    n, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    interpret = _interpreting()
    kernels = _kernels(interpret)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 is the default; unused for 16-bit inputs
    common = dict(
        key_len=key_len, window=_NO_WINDOW if window is None else window, qk_scale=scale * _LOG2E,
        KVH=kv_heads, GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_G=p.block_g, BLOCK_D=p.block_d,
        BLOCK_N=p.block_n, NUM_SPLITS=p.num_splits, PRECISION=precision, INTERPRET=interpret,
        ATTEND_BLOCK=kernels.attend_block, HAS_PREFIX=prefix_rows is not None, num_warps=p.num_warps,
        num_stages=p.num_stages,
    )
    prefix = (prefix_rows, prefix_lens) if prefix_rows is not None else (positions, positions)  # unread without
    grid = (n * kv_heads, p.num_splits)
    if p.num_splits == 1:
        kernels.attn_fwd[grid](
            q, k_cache, v_cache, positions, *prefix, out, out,
            q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
            out.stride(0), out.stride(1), 0, **common,
        )
        return
    part = torch.empty((n, num_heads, p.num_splits, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((n, num_heads, p.num_splits), dtype=torch.float32, device=q.device)
    kernels.attn_fwd[grid](
        q, k_cache, v_cache, positions, *prefix, part, lse,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        part.stride(0), part.stride(1), part.stride(2), **common,
    )
    kernels.combine[(n * num_heads,)](
        part, lse, out, out.stride(0), out.stride(1),
        H=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=p.num_splits,
        BLOCK_S=max(2, _next_pow2(p.num_splits)), BLOCK_D=p.block_d, num_warps=1 if p.block_d <= 64 else 2,
    )


@torch.library.custom_op("rlcli::decode_attention", mutates_args=())
def decode_attention_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor, key_len: int,
    scale: float, window: int, prefix_rows: torch.Tensor | None = None, prefix_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`decode_attention` as a PyTorch operator (``window`` 0 = none), so that
    ``torch.compile`` treats the Triton launch as one opaque call inside a compiled decode layer."""
    return decode_attention(q, k_cache, v_cache, positions, key_len, scale, window or None,
                            prefix_rows=prefix_rows, prefix_lens=prefix_lens)


@decode_attention_op.register_fake
def _(q, k_cache, v_cache, positions, key_len, scale, window, prefix_rows=None, prefix_lens=None):
    return torch.empty_like(q)
