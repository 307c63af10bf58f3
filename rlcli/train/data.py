"""Training sequences: shifted labels, per-token advantages, packing and mini-batches.

Alignment (one list entry per *input position*; position ``t`` predicts token ``t + 1``)::

    input_ids        = prompt + response[:-1]
    labels[t]        = [-100]*(len(prompt)-1) + [r if m else -100 for r, m in zip(response, mask)]
    advantages[t]    = A where labels[t] != -100, else 0
    rollout_logp[t]  = the rollout logprob of labels[t] where labels[t] != -100, else 0

XTuner builds the same ``input_ids``/``labels`` but a per-sample advantage list one element
longer than the labels (from the unshifted mask) and keeps rollout logprobs of masked tokens;
packed, its advantages drift by one position per preceding sample. Here every per-token list
has exactly one entry per label position, and masked positions are zero in all of them.

Packing puts sequences into packs of at most ``pack_max_length`` input tokens (first fit, in
order). A pack is run as one *micro-batch* in one of two layouts with identical results:

* ``packed``: one row, position ids restarting at 0 for every sequence. Transformers (>= 5)
  turns restarting ``position_ids`` with no ``attention_mask`` into a block-diagonal causal mask,
  so no token attends across sequences (varlen kernels use the same position ids).
* ``padded``: one right-padded row per sequence, no mask at all: with causal attention a real
  token only attends to earlier tokens of its own row, all real, and pad outputs are never read.

With dense (sdpa/eager) attention a packed row costs O(T²) attention over the whole pack, while
padded rows cost O(n·L²); :func:`choose_layout` picks the cheaper one (for RL batches of many
short sequences, padded is ~100x cheaper on CPU).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Literal

import torch

IGNORE_INDEX = -100
Layout = Literal["packed", "padded"]


@dataclass
class TrainSequence:
    """One sample to train on: a prompt, a sampled response and its advantage."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]  # 1 = trained on
    rollout_logprobs: list[float] | None  # logprob of each response token under the rollout engine
    advantage: float
    temperature: float = 1.0  # the sampling temperature; 0 (greedy) is treated as 1
    seq_id: int = 0  # caller's identifier (sample uid); not used for computation

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"sequence {self.seq_id}: prompt_ids is empty")
        if not self.response_ids:
            raise ValueError(f"sequence {self.seq_id}: response_ids is empty")
        if len(self.response_mask) != len(self.response_ids):
            raise ValueError(
                f"sequence {self.seq_id}: response_mask has {len(self.response_mask)} entries, "
                f"response_ids {len(self.response_ids)}"
            )
        if self.rollout_logprobs is not None and len(self.rollout_logprobs) != len(self.response_ids):
            raise ValueError(
                f"sequence {self.seq_id}: rollout_logprobs has {len(self.rollout_logprobs)} entries, "
                f"response_ids {len(self.response_ids)}"
            )
        if self.temperature < 0:
            raise ValueError(f"sequence {self.seq_id}: temperature must be >= 0, got {self.temperature}")

    @property
    def num_tokens(self) -> int:
        """Model input length: ``len(prompt) + len(response) - 1``."""
        return len(self.prompt_ids) + len(self.response_ids) - 1

    @property
    def num_valid(self) -> int:
        """Tokens that carry a loss (response tokens with mask 1)."""
        mask = self.response_mask
        return len(mask) - mask.count(0)

    @property
    def effective_temperature(self) -> float:
        return self.temperature if self.temperature > 0 else 1.0

    def build(self) -> tuple[list[int], list[int], list[float], list[float]]:
        """``(input_ids, labels, advantages, rollout_logprobs)``, each ``num_tokens`` long."""
        prompt, resp, mask = self.prompt_ids, self.response_ids, self.response_mask
        pad = [IGNORE_INDEX] * (len(prompt) - 1)
        zeros = [0.0] * (len(prompt) - 1)
        input_ids = list(prompt) + list(resp[:-1])
        labels = pad + [r if m else IGNORE_INDEX for r, m in zip(resp, mask)]
        adv = zeros + [float(self.advantage) if m else 0.0 for m in mask]
        lps = self.rollout_logprobs if self.rollout_logprobs is not None else [0.0] * len(resp)
        logp = zeros + [float(lp) if m else 0.0 for lp, m in zip(lps, mask)]
        return input_ids, labels, adv, logp

    def with_full_mask(self) -> "TrainSequence":
        """A copy whose every response token carries a label (for logprob evaluation)."""
        return TrainSequence(self.prompt_ids, self.response_ids, [1] * len(self.response_ids),
                             self.rollout_logprobs, self.advantage, self.temperature, self.seq_id)


@dataclass
class Pack:
    """Indices (into the caller's sequence list) of the sequences run together as one micro-batch."""

    indices: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


def pack_sequences(seqs: list[TrainSequence], pack_max_length: int, indices: list[int] | None = None) -> list[Pack]:
    """First-fit packing of ``seqs`` (or the subset ``indices``) into packs of <= ``pack_max_length`` tokens.

    Each sequence goes into the first pack with room, else opens a new one; sequences keep their
    relative order within a pack. Deterministic. A sequence longer than ``pack_max_length``
    raises ``ValueError``.
    """
    if pack_max_length <= 0:
        raise ValueError(f"pack_max_length must be positive, got {pack_max_length}")
    packs: list[Pack] = []
    room: list[int] = []
    for i in range(len(seqs)) if indices is None else indices:
        n = seqs[i].num_tokens
        if n > pack_max_length:
            raise ValueError(
                f"sequence {seqs[i].seq_id} has {n} input tokens (prompt {len(seqs[i].prompt_ids)} + response "
                f"{len(seqs[i].response_ids)} - 1), more than pack_max_length={pack_max_length}"
            )
        for p, free in enumerate(room):
            if n <= free:
                break
        else:
            p = len(packs)
            packs.append(Pack())
            room.append(pack_max_length)
        packs[p].indices.append(i)
        packs[p].lengths.append(n)
        room[p] -= n
    return packs


def split_minibatches(token_counts: list[int], num: int) -> list[list[int]]:
    """Split ``range(len(token_counts))`` into ``num`` contiguous, token-balanced index lists.

    Boundaries sit as close as possible to ``i/num`` of the total tokens, each mini-batch keeping
    at least one sequence while there are enough; with fewer sequences than ``num`` the trailing
    mini-batches are empty. Deterministic.
    """
    if num <= 0:
        raise ValueError(f"the number of mini-batches must be positive, got {num}")
    m = len(token_counts)
    if m <= num:
        return [[i] if i < m else [] for i in range(num)]
    cum = [0]
    for c in token_counts:
        cum.append(cum[-1] + c)
    total = cum[-1]
    bounds = [0]
    for i in range(1, num):
        target = total * i / num
        lo, hi = bounds[-1] + 1, m - (num - i)
        j = bisect.bisect_left(cum, target, lo, hi + 1)
        if j > lo and (j > hi or target - cum[j - 1] <= cum[j] - target):
            j -= 1
        bounds.append(min(max(j, lo), hi))
    bounds.append(m)
    return [list(range(bounds[i], bounds[i + 1])) for i in range(num)]


@dataclass(frozen=True)
class LayoutCost:
    """Relative cost of a micro-batch: per input token (linear layers) and per attended pair."""

    per_token: float
    per_pair: float
    varlen: bool = False  # attention kernel skips cross-sequence pairs of a packed row (flash/flex)

    @classmethod
    def from_config(cls, config, attn_implementation: str | None = None) -> "LayoutCost":
        h = config.hidden_size
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or h // heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        inter = getattr(config, "intermediate_size", 4 * h)
        per_layer = h * head_dim * (2 * heads + 2 * kv) + 3 * h * inter
        impl = attn_implementation or getattr(config, "_attn_implementation", None) or "sdpa"
        return cls(per_token=2.0 * per_layer, per_pair=4.0 * heads * head_dim,
                   varlen="flash" in impl or "flex" in impl)


def choose_layout(lengths: list[int], max_tokens: int, cost: LayoutCost) -> Layout:
    """``padded`` when it is cheaper than one packed row and fits in ``max_tokens`` padded tokens."""
    n = len(lengths)
    if n <= 1:
        return "packed"
    longest, total = max(lengths), sum(lengths)
    if n * longest > max_tokens:
        return "packed"
    pairs_packed = sum(x * x for x in lengths) / 2 if cost.varlen else float(total) * total
    packed = total * cost.per_token + pairs_packed * cost.per_pair
    padded = n * longest * cost.per_token + n * longest * longest / 2 * cost.per_pair
    return "padded" if padded < packed else "packed"


@dataclass
class MicroBatch:
    """Model inputs of one pack plus per-label tensors (``N`` = label positions, in sequence order)."""

    input_ids: torch.Tensor  # [B, L] long
    position_ids: torch.Tensor  # [B, L] long
    label_index: torch.Tensor  # [N] long: flat index into the B*L positions
    labels: torch.Tensor  # [N] long
    advantages: torch.Tensor  # [N] float32
    rollout_logprobs: torch.Tensor  # [N] float32 (0 where unknown)
    has_rollout_logprobs: torch.Tensor  # [N] bool
    inv_temperature: torch.Tensor  # [N] float32
    seq_index: torch.Tensor  # [N] long: index of the token's sequence in the caller's list
    seq_local: torch.Tensor  # [N] long: index of the token's sequence within this pack (0..len(seq_indices)-1)
    seq_indices: list[int]  # the caller's index of each sequence of the pack, in pack order
    label_counts: list[int]  # label positions per sequence of the pack, in pack order
    layout: Layout
    unit_temperature: bool = False  # every temperature is 1: the logits need no scaling

    @property
    def num_labels(self) -> int:
        return int(self.labels.numel())

    def to(self, device: torch.device) -> "MicroBatch":
        kw = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}
        return MicroBatch(**kw)


def build_micro_batch(seqs: list[TrainSequence], pack: Pack, layout: Layout, pad_id: int = 0) -> MicroBatch:
    """Tensorise one pack in the given layout (see the module docstring)."""
    rows_ids: list[list[int]] = []
    label_index: list[int] = []
    labels: list[int] = []
    adv: list[float] = []
    rlp: list[float] = []
    has_rlp: list[bool] = []
    inv_t: list[float] = []
    seq_index: list[int] = []
    seq_local: list[int] = []
    counts: list[int] = []
    longest = max(pack.lengths) if pack.lengths else 1
    offset = 0
    for row, i in enumerate(pack.indices):
        s = seqs[i]
        prompt, resp, mask = s.prompt_ids, s.response_ids, s.response_mask
        rows_ids.append(list(prompt) + list(resp[:-1]))
        # Response token j is predicted at input position len(prompt) - 1 + j.
        first = (row * longest if layout == "padded" else offset) + len(prompt) - 1
        lps = s.rollout_logprobs
        if all(mask):  # the common case, without a Python loop per token
            n = len(resp)
            label_index.extend(range(first, first + n))
            labels.extend(resp)
            rlp.extend(lps if lps is not None else [0.0] * n)
        else:
            js = [j for j, m in enumerate(mask) if m]
            n = len(js)
            label_index.extend([first + j for j in js])
            labels.extend([resp[j] for j in js])
            rlp.extend([lps[j] for j in js] if lps is not None else [0.0] * n)
        adv.extend([float(s.advantage)] * n)
        has_rlp.extend([s.rollout_logprobs is not None] * n)
        inv_t.extend([1.0 / s.effective_temperature] * n)
        seq_index.extend([i] * n)
        seq_local.extend([row] * n)
        counts.append(n)
        offset += s.num_tokens
    if layout == "padded":
        flat = []
        for ids in rows_ids:
            flat.extend(ids)
            flat.extend([pad_id] * (longest - len(ids)))
        input_ids = torch.tensor(flat, dtype=torch.long).view(len(rows_ids), longest)
        position_ids = torch.arange(longest).expand(len(rows_ids), longest).contiguous()
    else:
        flat, pos = [], []
        for ids in rows_ids:
            flat.extend(ids)
            pos.extend(range(len(ids)))
        input_ids = torch.tensor([flat or [pad_id]], dtype=torch.long)
        position_ids = torch.tensor([pos or [0]], dtype=torch.long)
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        label_index=torch.tensor(label_index, dtype=torch.long),
        labels=torch.tensor(labels, dtype=torch.long),
        advantages=torch.tensor(adv, dtype=torch.float32),
        rollout_logprobs=torch.tensor(rlp, dtype=torch.float32),
        has_rollout_logprobs=torch.tensor(has_rlp, dtype=torch.bool),
        inv_temperature=torch.tensor(inv_t, dtype=torch.float32),
        seq_index=torch.tensor(seq_index, dtype=torch.long),
        seq_local=torch.tensor(seq_local, dtype=torch.long),
        seq_indices=list(pack.indices),
        label_counts=counts,
        layout=layout,
        unit_temperature=all(t == 1.0 for t in inv_t),
    )


def empty_micro_batch(pad_id: int = 0) -> MicroBatch:
    """A one-token micro-batch with no labels: lets a rank with fewer packs join the collectives."""
    return build_micro_batch([], Pack(), "packed", pad_id)
