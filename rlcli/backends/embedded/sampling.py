"""Sampling of the embedded engine: a counter-based RNG and inverse-CDF draws.

Sampling is a function of (request seed, token position, logits) only: each row draws one
uniform number from a counter-based hash of its seed and the absolute position of the token
(:func:`counter_uniform`) and inverts the CDF of its (temperature-scaled, top-k/top-p filtered)
distribution (:func:`sample_tokens`, :func:`sample_plain`). A request therefore yields the same
tokens whatever else is in the batch and whenever it is admitted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlcli.backends.seeds import M64, splitmix64

# ------------------------------------------------------------------------------------------
# Counter-based randomness
# ------------------------------------------------------------------------------------------
_M32 = 0xFFFFFFFF
# Multiplier of a well-mixing 32-bit integer hash; below 2**31, so products of 32-bit values
# stay below 2**63 and int64 tensor arithmetic never overflows.
_HASH_MUL = 0x45D9F3B


def seed_keys(seed: int) -> tuple[int, int]:
    """The two 32-bit hash keys a request's seed (any Python int) is reduced to."""
    h1 = splitmix64(seed & M64)
    h2 = splitmix64(h1)
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
