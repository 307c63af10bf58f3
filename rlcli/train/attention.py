"""Attention for the ``shared`` pack layout: each prompt run once for all of its responses.

In the ``shared`` layout (:mod:`rlcli.train.data`) a pack is one row of tokens in which each
prompt appears once, followed by the response inputs of every sequence that has it. Per-token
layers are unaffected; only attention must know that a response sees its own prompt and itself,
never another response. :func:`shared_prompt_attention` does this with the ordinary causal kernel:

1. gather queries, keys and values into one right-padded row per sequence (``attn_rows``: the
   prompt's tokens, then the response's), so that each row holds one ordinary causal sequence;
2. run causal scaled-dot-product attention over the rows (the same kernel, and the same GQA
   handling, as transformers' ``sdpa`` implementation);
3. read each token's output from the row that owns it (``attn_owner``): a response token from its
   sequence's row, a prompt token from the row of the first sequence with that prompt.

The backward passes, written out (:class:`_GatherRows`, :class:`_TakeOwned`) so that none of them
needs a half-precision scatter-add (which Inductor leaves to a slow sorting kernel):

* keys and values: each token's gradient is the sum over the rows that hold it; a prompt's keys
  and values thus receive the gradients of every response's row, as they would have had each
  sequence been run on its own. The sum is taken in float32.
* queries: only the owner's copy of a token is ever read, and a query whose output gradient is
  zero gets a zero gradient from attention, so a token's gradient is its owner's, a plain gather;
* outputs: each row position owns at most one token, so the gradient goes back by a plain copy.

Padding indices point at token 0 and sit after each row's last real token, where causal attention
never looks back at them.

Prompts are usually short next to their responses, so the attention work repeated per row is
small; what is saved is every per-token layer over ``(group size - 1)`` copies of each prompt.
"""

from __future__ import annotations

import torch
from torch import nn

SHARED_PROMPT_ATTENTION = "rlcli_shared_prompt"


def shared_prompt_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0,
                            scaling: float | None = None, **kwargs):
    """A transformers attention function (``AttentionInterface``): inputs ``[1, heads, T, d]``,
    output ``[1, T, heads, d]``. With ``attn_rows``/``attn_owner`` in ``kwargs`` it attends within
    each sequence's row (see the module docstring); without them (a one-token placeholder batch,
    say) it is transformers' ``sdpa`` attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows = kwargs.pop("attn_rows", None)
    owner = kwargs.pop("attn_owner", None)
    if rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"the shared layout runs one row of tokens, got a batch of {query.shape[0]}")
    kwargs.pop("is_causal", None)
    n, width = rows.shape
    flat = rows.reshape(-1)

    def per_row(x: torch.Tensor, owned: bool) -> torch.Tensor:  # [1, H, T, d] -> [n, H, width, d]
        tokens = x[0].transpose(0, 1)  # [T, H, d]
        return _GatherRows.apply(tokens, flat, owner if owned else None).view(n, width, *tokens.shape[1:]).transpose(1, 2)

    out, _ = sdpa_attention_forward(module, per_row(query, True), per_row(key, False), per_row(value, False), None,
                                    dropout=dropout, scaling=scaling, is_causal=True, **kwargs)  # [n, width, H, d]
    return _TakeOwned.apply(out.reshape(n * width, *out.shape[2:]), owner).unsqueeze(0), None


class _GatherRows(torch.autograd.Function):
    """``tokens[flat]``. Backward: with ``owner``, the gradient of each token's owner position
    (exact when no other position's gradient is nonzero: the queries); without, the float32 sum
    over every position holding the token (keys, values)."""

    @staticmethod
    def forward(ctx, tokens, flat, owner):
        ctx.save_for_backward(flat, owner)
        ctx.num_tokens = tokens.shape[0]
        return tokens.index_select(0, flat)

    @staticmethod
    def backward(ctx, grad):
        flat, owner = ctx.saved_tensors
        if owner is not None:
            return grad.index_select(0, owner), None, None
        acc = grad.new_zeros((ctx.num_tokens, *grad.shape[1:]), dtype=torch.float32)
        return acc.index_add_(0, flat, grad.float()).to(grad.dtype), None, None


class _TakeOwned(torch.autograd.Function):
    """``rows[owner]`` where ``owner`` has no repeats; backward: a zero-filled copy, no accumulation."""

    @staticmethod
    def forward(ctx, rows, owner):
        ctx.save_for_backward(owner)
        ctx.num_rows = rows.shape[0]
        return rows.index_select(0, owner)

    @staticmethod
    def backward(ctx, grad):
        (owner,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.num_rows, *grad.shape[1:]))
        return out.index_copy(0, owner, grad), None


def use_shared_prompt_attention(lm: nn.Module) -> None:
    """Make ``lm`` (a transformers model) attend through :func:`shared_prompt_attention`.

    ``ValueError`` for a model this cannot serve: one whose attention does not go through
    transformers' attention interface, or one with layers other than full causal attention
    (sliding windows, chunked attention: the rows here would attend past their window).
    """
    from transformers import AttentionInterface

    name = type(lm).__name__
    if not getattr(lm, "_supports_attention_backend", False):
        raise ValueError(f"train_worker.share_prompts: {name} does not take attention functions from transformers' "
                         "AttentionInterface, so its attention cannot be run per sequence; set share_prompts: false")
    config = lm.config
    kinds = getattr(config, "layer_types", None)
    if not kinds:  # configs without per-layer types
        windowed = getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None)
        kinds = ["sliding_attention" if windowed else "full_attention"]
    if set(kinds) != {"full_attention"}:
        raise ValueError(f"train_worker.share_prompts: {name} has attention layers other than full causal attention "
                         f"({sorted(set(kinds))}), which the shared layout does not implement; set share_prompts: false")
    AttentionInterface.register(SHARED_PROMPT_ATTENTION, shared_prompt_attention)
    lm.config._attn_implementation = SHARED_PROMPT_ATTENTION
