"""The KV cache an engine needs for a run's workload: :class:`KVShape` (from the model's
``config.json``), :func:`plan_kv_cache` and the :class:`KVBudget` it returns.

The rule (the engine plugins' ``auto`` memory option):

* sequences = the workload's sequences in flight (:class:`~rlcli.backends.base.RolloutWorkload`),
  at most the engine's concurrency limit when the plugin's ``max_batch_size`` option is set;
* tokens per sequence = the longest prompt + ``max_tokens`` (at most ``max_model_len``; the
  whole ``max_model_len`` when the workload does not say), rounded up to the engine's block size;
* blocks = sequences x blocks per sequence, at least one ``max_model_len`` sequence (every engine
  checks or caps its context against the cache), plus :data:`KV_MARGIN_PERCENT` (10 %, rounded up)
  and the blocks the engine reserves for itself;
* bytes = blocks x block size x ``2 x layers x kv_heads x head_dim x dtype bytes``;
* on a GPU, at most :data:`AUTO_MAX_SHARE` of the memory free when the engine starts, less the
  weights: a workload that needs more (an eval set of thousands of prompts) gets that and the
  engine queues what does not fit (a warning names the options that size it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from pydantic import Field

from rlcli.backends.base import RolloutWorkload

KV_MARGIN_PERCENT = 10  # extra blocks over the computed need (engine-side bookkeeping, rounding)
AUTO_MAX_SHARE = 0.5  # the most of (free device memory - weights) an automatic KV cache takes


# An engine plugin's memory option: "auto" (the KV cache from plan_kv_cache) or a share in (0, 1).
MemoryShare = Annotated[float, Field(gt=0.0, lt=1.0)] | Literal["auto"]


def memory_option(knob: str, share: str) -> Any:
    """The ``Field`` of an engine plugin's memory option (type :data:`MemoryShare`, or a variant):
    default "auto", passed to the engine as ``knob``; ``share`` says what a number means."""
    return Field("auto", description=f"'auto': a KV cache sized from the recipe (sequences in flight x their longest "
                 f"prompt + max_tokens, +{KV_MARGIN_PERCENT} %; passed as {knob}; docs/backends.md, 'KV cache'). A "
                 f"number: {share}; leave room for the colocated trainer. An explicit number wins.")


@dataclass(frozen=True)
class KVShape:
    """What one token's keys and values take in a decoder: ``layers x kv_heads x head_dim``."""

    layers: int
    kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * int(dtype_bytes)


def kv_shape_from_config(cfg: Any) -> KVShape:
    """The KV shape of a decoder from its transformers (text) config: ``num_key_value_heads``
    defaults to ``num_attention_heads`` and ``head_dim`` to ``hidden_size // num_attention_heads``.
    Raises TypeError when the config has no head or layer counts."""
    heads = int(getattr(cfg, "num_attention_heads", None))
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or int(getattr(cfg, "hidden_size", None)) // heads)
    return KVShape(layers=int(getattr(cfg, "num_hidden_layers", None)), kv_heads=kv_heads, head_dim=head_dim)


@dataclass(frozen=True)
class KVBudget:
    """A KV cache of ``blocks`` blocks of ``block_size`` tokens (see the module docstring)."""

    sequences: int  # sequences in flight it is sized for
    sequence_tokens: int  # prompt + response tokens per sequence, before rounding
    block_size: int
    blocks: int  # margin and reserved blocks included
    bytes_per_token: int
    capped_blocks: int | None = None  # the blocks the workload asked for, when the device cap cut them

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.tokens * self.bytes_per_token

    def describe(self) -> str:
        text = (f"{self.tokens} tokens ({self.nbytes / 2**20:.1f} MiB): {self.sequences} sequences x "
                f"{self.sequence_tokens} tokens in blocks of {self.block_size}, +{KV_MARGIN_PERCENT}%")
        if self.capped_blocks is not None:
            text += (f"; the workload asked for {self.capped_blocks * self.block_size} tokens, more than "
                     f"{AUTO_MAX_SHARE:.0%} of the free device memory")
        return text


def plan_kv_cache(workload: RolloutWorkload | None, shape: KVShape, *, dtype_bytes: int, block_size: int,
                  max_model_len: int | None, concurrency: int | None = None, reserved_blocks: int = 0,
                  free_bytes: int | None = None, weight_bytes: int = 0) -> KVBudget | None:
    """The KV cache for ``workload`` (see the module docstring); None when the number of sequences
    is unknown (no workload and no ``concurrency``) or neither a sequence length nor
    ``max_model_len`` is known: the engine then sizes its cache its own way."""
    sequences = workload.max_sequences if workload is not None else None
    if concurrency:
        sequences = min(sequences, concurrency) if sequences else concurrency
    length = workload.max_sequence_tokens if workload is not None else None
    if max_model_len:
        length = min(length, max_model_len) if length else max_model_len
    if not sequences or not length:
        return None
    need = sequences * math.ceil(length / block_size)
    if max_model_len:
        need = max(need, math.ceil(max_model_len / block_size) + 1)
    blocks = need + -(-need * KV_MARGIN_PERCENT // 100) + reserved_blocks
    budget = KVBudget(sequences, length, block_size, blocks, shape.bytes_per_token(dtype_bytes))
    if free_bytes is not None:
        cap = int(AUTO_MAX_SHARE * max(0, free_bytes - weight_bytes)) // (block_size * budget.bytes_per_token)
        if cap < blocks:
            budget = replace(budget, blocks=max(cap, reserved_blocks + 1), capped_blocks=blocks)
    return budget
