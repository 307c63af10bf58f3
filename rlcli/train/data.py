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
order). A pack is run as one *micro-batch* in one of these layouts, with identical results:

* ``packed``: one row, position ids restarting at 0 for every sequence. Transformers (>= 5)
  turns restarting ``position_ids`` with no ``attention_mask`` into a block-diagonal causal mask,
  so no token attends across sequences (varlen kernels use the same position ids).
* ``padded``: one right-padded row per sequence, no mask at all: with causal attention a real
  token only attends to earlier tokens of its own row, all real, and pad outputs are never read.

With dense (sdpa/eager) attention a packed row costs O(T²) attention over the whole pack, while
padded rows cost O(n·L²); :func:`choose_layout` picks the cheaper one (for RL batches of many
short sequences, padded is ~100x cheaper on CPU).

A third layout, ``shared`` (``train_worker.share_prompts``), runs every prompt of a pack once for
all of its responses. The model's input is one row: each prompt, then ``response[:-1]`` of each
sequence with that prompt, position ids continuing from the prompt's length. Every per-token
layer (projections, MLP, norms) then sees each prompt token once. Attention
(:mod:`rlcli.train.attention`) gathers its queries, keys and values into one right-padded row per
sequence (``attn_rows``: prompt, then response), runs causal attention there, and takes each
token's output back from the row that owns it (``attn_owner``: a prompt's first sequence). The
first response token of every sequence of a group is predicted at the one last prompt position.
Results equal the other layouts' up to floating-point summation order; :func:`pack_shared`
keeps the sequences of a prompt together in a pack.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

import numpy as np
import torch

IGNORE_INDEX = -100
Layout = Literal["packed", "padded", "shared"]


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


def _first_fit(sizes: list[int], capacity: int) -> list[list[int]]:
    """First fit of items of ``sizes`` into bins of ``capacity``: the item indices of each bin, in order."""
    bins: list[list[int]] = []
    room: list[int] = []
    for k, n in enumerate(sizes):
        for b, free in enumerate(room):
            if n <= free:
                break
        else:
            b = len(bins)
            bins.append([])
            room.append(capacity)
        bins[b].append(k)
        room[b] -= n
    return bins


def _first_fit_balanced(sizes: list[int], capacity: int) -> list[list[int]]:
    """As many bins as :func:`_first_fit` makes, filled evenly (see :func:`pack_balanced`)."""
    bins = _first_fit(sizes, capacity)
    if len(bins) <= 1:
        return bins
    lo, hi = max(max(sizes), -(-sum(sizes) // len(bins))), capacity
    best = bins
    while lo < hi:
        mid = (lo + hi) // 2
        trial = _first_fit(sizes, mid)
        if len(trial) <= len(bins):
            best, hi = trial, mid
        else:
            lo = mid + 1
    return best  # the bins of capacity ``hi``, the last one tried successfully


def _checked_sizes(seqs: list[TrainSequence], pack_max_length: int, indices) -> tuple[list[int], list[int]]:
    """``(indices, num_tokens of each)``; ``ValueError`` for a sequence longer than ``pack_max_length``."""
    if pack_max_length <= 0:
        raise ValueError(f"pack_max_length must be positive, got {pack_max_length}")
    idx = list(range(len(seqs))) if indices is None else list(indices)
    sizes = []
    for i in idx:
        n = seqs[i].num_tokens
        if n > pack_max_length:
            raise ValueError(
                f"sequence {seqs[i].seq_id} has {n} input tokens (prompt {len(seqs[i].prompt_ids)} + response "
                f"{len(seqs[i].response_ids)} - 1), more than pack_max_length={pack_max_length}"
            )
        sizes.append(n)
    return idx, sizes


def _packs(seqs: list[TrainSequence], units: list[list[int]], bins: list[list[int]]) -> list[Pack]:
    packs = []
    for b in bins:
        indices = [i for u in b for i in units[u]]
        packs.append(Pack(indices, [seqs[i].num_tokens for i in indices]))
    return packs


def pack_sequences(seqs: list[TrainSequence], pack_max_length: int, indices: list[int] | None = None) -> list[Pack]:
    """First-fit packing of ``seqs`` (or the subset ``indices``) into packs of <= ``pack_max_length`` tokens.

    Each sequence goes into the first pack with room, else opens a new one; sequences keep their
    relative order within a pack. Deterministic. A sequence longer than ``pack_max_length``
    raises ``ValueError``.
    """
    idx, sizes = _checked_sizes(seqs, pack_max_length, indices)
    return _packs(seqs, [[i] for i in idx], _first_fit(sizes, pack_max_length))


def pack_balanced(seqs: list[TrainSequence], pack_max_length: int, indices: list[int] | None = None) -> list[Pack]:
    """As many packs as :func:`pack_sequences` makes, filled evenly.

    First fit fills every pack but the last, which may hold a handful of tokens: a runt
    micro-batch whose kernels are too small to hide their launch cost (on the H200 the
    2-sequence sixth micro-batch of a 512-sequence batch took ~0.2 s under torch.profiler, the
    GPU mostly idle). Here the capacity is lowered to the smallest that still gives first fit
    the same number of packs (binary search; first fit is deterministic, so the result is too).
    Which sequences share a pack changes nothing in the loss: it is normalised by global counts.
    """
    idx, sizes = _checked_sizes(seqs, pack_max_length, indices)
    return _packs(seqs, [[i] for i in idx], _first_fit_balanced(sizes, pack_max_length))


def prompt_groups(seqs: Sequence[TrainSequence], indices) -> list[list[int]]:
    """``indices`` grouped by identical ``prompt_ids``: groups in order of first appearance, members in order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in indices:
        groups.setdefault(tuple(seqs[i].prompt_ids), []).append(i)
    return list(groups.values())


def pack_shared(seqs: list[TrainSequence], pack_max_length: int, indices: list[int] | None = None) -> list[Pack]:
    """:func:`pack_balanced` for the ``shared`` layout: its units are the sequences of one prompt,
    counted with the prompt once. A prompt whose sequences exceed ``pack_max_length`` together is
    split into consecutive parts that fit, each with its own copy of the prompt."""
    idx, _ = _checked_sizes(seqs, pack_max_length, indices)
    units: list[list[int]] = []
    sizes: list[int] = []
    for members in prompt_groups(seqs, idx):
        prompt = len(seqs[members[0]].prompt_ids)
        part, size = [], prompt
        for i in members:
            extra = len(seqs[i].response_ids) - 1
            if part and size + extra > pack_max_length:
                units.append(part)
                sizes.append(size)
                part, size = [], prompt
            part.append(i)
            size += extra
        units.append(part)
        sizes.append(size)
    return _packs(seqs, units, _first_fit_balanced(sizes, pack_max_length))


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
    """``padded`` when it is cheaper than one packed row and fits in ``max_tokens`` padded tokens.

    With dense attention (no varlen kernel) a packed row also holds a ``total x total`` attention
    matrix per head, so padding may then take up to twice ``max_tokens``: a pack of a thousand
    10-token responses is 40x faster padded than as one masked row of 10,000 tokens."""
    n = len(lengths)
    if n <= 1:
        return "packed"
    longest, total = max(lengths), sum(lengths)
    if n * longest > (max_tokens if cost.varlen else 2 * max_tokens):
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
    # the ``shared`` layout only (else None): each sequence's attention row, as indices into the
    # pack's tokens ([n_seq, L] long), and where each token's attention output is read ([T] long,
    # a flat index into the n_seq * L row positions)
    attn_rows: torch.Tensor | None = None
    attn_owner: torch.Tensor | None = None

    @property
    def num_labels(self) -> int:
        return int(self.labels.numel())

    def to(self, device: torch.device) -> "MicroBatch":
        """A copy on ``device``. To a GPU the tensors go through pinned memory, so that each copy is
        asynchronous (from pageable memory CUDA may make the host wait for it)."""
        pin = device.type == "cuda"
        kw = {k: ((v.pin_memory() if pin else v).to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
              for k, v in vars(self).items()}
        return MicroBatch(**kw)


T = TypeVar("T")


class LazyList(Sequence, Generic[T]):
    """A list whose item ``i`` is ``makers[i]()``, called on first access and kept."""

    def __init__(self, makers: list[Callable[[], T]]):
        self._makers: list[Callable[[], T] | None] = list(makers)  # None once built
        self._items: list[T | None] = [None] * len(makers)

    def __len__(self) -> int:
        return len(self._makers)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        make = self._makers[i]  # IndexError past the end, as a list
        if make is not None:
            self._items[i], self._makers[i] = make(), None
        return self._items[i]


def build_micro_batch(seqs: list[TrainSequence], pack: Pack, layout: Layout, pad_id: int = 0) -> MicroBatch:
    """Tensorise one pack in the given layout (see the module docstring).

    Token lists are joined with C-level list operations and converted once per field; per-token
    values that are constant within a sequence are expanded with ``np.repeat``, so the cost is a
    few passes over the pack's tokens, not a Python loop per token (a 32k-token pack of 102
    sequences: ~5 ms, against ~25 ms for per-token lists, on a 2-core CPU).
    """
    sel = [seqs[i] for i in pack.indices]
    n_seq = len(sel)
    labels: list[int] = []
    rlp: list[float] = []
    counts = np.zeros(n_seq, dtype=np.int64)
    partial: dict[int, np.ndarray] = {}  # row -> the response offsets that carry a label (mask not all ones)
    for row, s in enumerate(sel):
        resp, mask, lps = s.response_ids, s.response_mask, s.rollout_logprobs
        if all(mask):  # the common case
            labels += resp
            rlp += lps if lps is not None else [0.0] * len(resp)
            counts[row] = len(resp)
        else:
            js = np.flatnonzero(np.asarray(mask, dtype=bool))
            partial[row] = js
            labels += np.asarray(resp, dtype=np.int64)[js].tolist()
            rlp += np.asarray(lps, dtype=np.float64)[js].tolist() if lps is not None else [0.0] * len(js)
            counts[row] = len(js)
    total = int(counts.sum())
    starts = np.cumsum(counts) - counts  # where each sequence's labels begin
    within = np.arange(total, dtype=np.int64) - np.repeat(starts, counts)  # offset inside the response
    for row, js in partial.items():
        within[starts[row]: starts[row] + counts[row]] = js
    attn_rows = attn_owner = None
    if layout == "shared":
        input_ids, position_ids, label_index, attn_rows, attn_owner = _shared_inputs(sel, counts, within)
    else:
        input_ids, position_ids, label_index = _row_inputs(sel, pack, layout, counts, within, pad_id)
    per_seq = lambda values, dtype: np.repeat(np.asarray(values, dtype=dtype), counts)  # noqa: E731
    inv_t = [1.0 / s.effective_temperature for s in sel]
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        label_index=torch.from_numpy(label_index),
        labels=torch.from_numpy(np.array(labels, dtype=np.int64)),
        advantages=torch.from_numpy(per_seq([float(s.advantage) for s in sel], np.float32)),
        rollout_logprobs=torch.from_numpy(np.array(rlp, dtype=np.float32)),
        has_rollout_logprobs=torch.from_numpy(per_seq([s.rollout_logprobs is not None for s in sel], np.bool_)),
        inv_temperature=torch.from_numpy(per_seq(inv_t, np.float32)),
        seq_index=torch.from_numpy(per_seq(pack.indices, np.int64)),
        seq_local=torch.from_numpy(per_seq(np.arange(n_seq), np.int64)),
        seq_indices=list(pack.indices),
        label_counts=counts.tolist(),
        layout=layout,
        unit_temperature=all(t == 1.0 for t in inv_t),
        attn_rows=attn_rows,
        attn_owner=attn_owner,
    )


def _row_inputs(sel: list[TrainSequence], pack: Pack, layout: Layout, counts: np.ndarray, within: np.ndarray,
                pad_id: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """``(input_ids, position_ids, label_index)`` of the ``packed`` and ``padded`` layouts."""
    n_seq = len(sel)
    longest = max(pack.lengths) if pack.lengths else 1
    ids: list[int] = []
    firsts = np.zeros(n_seq, dtype=np.int64)
    offset = 0
    for row, s in enumerate(sel):
        ids += s.prompt_ids
        ids += s.response_ids[:-1]
        if layout == "padded":
            ids += [pad_id] * (longest - s.num_tokens)
        # Response token j is predicted at input position len(prompt) - 1 + j.
        firsts[row] = (row * longest if layout == "padded" else offset) + len(s.prompt_ids) - 1
        offset += s.num_tokens
    label_index = np.repeat(firsts, counts) + within
    if layout == "padded":
        input_ids = torch.from_numpy(np.array(ids, dtype=np.int64)).view(n_seq, longest)
        position_ids = torch.arange(longest).expand(n_seq, longest).contiguous()
    else:
        lens = np.asarray(pack.lengths, dtype=np.int64)
        pos = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
        input_ids = torch.from_numpy(np.array(ids or [pad_id], dtype=np.int64)).view(1, -1)
        position_ids = torch.from_numpy(pos if len(pos) else np.zeros(1, dtype=np.int64)).view(1, -1)
    return input_ids, position_ids, label_index


def _shared_inputs(sel: list[TrainSequence], counts: np.ndarray, within: np.ndarray):
    """``(input_ids, position_ids, label_index, attn_rows, attn_owner)`` of the ``shared`` layout."""
    n_seq = len(sel)
    plen = np.array([len(s.prompt_ids) for s in sel], dtype=np.int64)
    rlen = np.array([len(s.response_ids) - 1 for s in sel], dtype=np.int64)  # response inputs
    width = int((plen + rlen).max())
    ids: list[int] = []
    pos: list[np.ndarray] = []
    owner: list[np.ndarray] = []
    rows = np.zeros((n_seq, width), dtype=np.int64)  # padding points at token 0: causal attention never reads it
    prompt_last = np.zeros(n_seq, dtype=np.int64)
    resp_start = np.zeros(n_seq, dtype=np.int64)
    offset = 0
    for members in prompt_groups(sel, range(n_seq)):
        p = int(plen[members[0]])
        ids += sel[members[0]].prompt_ids
        prompt = np.arange(offset, offset + p, dtype=np.int64)
        pos.append(np.arange(p, dtype=np.int64))
        owner.append(members[0] * width + np.arange(p, dtype=np.int64))  # the first sequence's row owns the prompt
        offset += p
        for r in members:
            n = int(rlen[r])
            ids += sel[r].response_ids[:-1]
            pos.append(np.arange(p, p + n, dtype=np.int64))
            owner.append(r * width + np.arange(p, p + n, dtype=np.int64))
            rows[r, :p] = prompt
            rows[r, p:p + n] = np.arange(offset, offset + n, dtype=np.int64)
            prompt_last[r] = prompt[-1]
            resp_start[r] = offset
            offset += n
    # Response token 0 is predicted at the prompt's last position, token j > 0 at response input j - 1.
    label_index = np.where(within == 0, np.repeat(prompt_last, counts), np.repeat(resp_start - 1, counts) + within)
    return (torch.from_numpy(np.array(ids, dtype=np.int64)).view(1, -1),
            torch.from_numpy(np.concatenate(pos)).view(1, -1), label_index,
            torch.from_numpy(rows), torch.from_numpy(np.concatenate(owner)))


def empty_micro_batch(pad_id: int = 0) -> MicroBatch:
    """A one-token micro-batch with no labels: lets a rank with fewer packs join the collectives."""
    return build_micro_batch([], Pack(), "packed", pad_id)
