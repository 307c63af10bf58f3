"""Rollout/training mismatch: metrics and importance-sampling correction (TIS / MIS).

The inference engine samples with its own kernels (and often another precision), so the
log-prob it reports for a sampled token differs from the trainer's. The trainer's log-probs
before the update (``old``) define the policy the PPO ratio is taken against; the tokens were
drawn from the engine's policy (``rollout``). The importance weight of a token is

    token:      w_t = exp(old_t - rollout_t)
    sequence:   w_t = exp(sum over the sequence of (old - rollout))      (shared by its tokens)
    geometric:  w_t = exp(mean over the sequence of (old - rollout))     (shared by its tokens)

with the exponent clamped to [-20, 20]. ``train_worker.rollout_is`` (``RolloutISConfig``) then

* **truncate** (TIS): multiplies each token's loss weight by ``clamp(w, threshold_lower, threshold_upper)``;
* **mask** (MIS): drops tokens whose ``w`` lies outside ``[mask_lower, mask_upper]`` and multiplies the
  rest by ``w``; **both**: drops as ``mask``, then multiplies by the truncated weight;
* **veto**: drops every token of a sequence in which any token's ratio ``exp(old_t - rollout_t)``
  lies outside ``[veto_lower, veto_upper]``, whatever the mode.

Dropped tokens behave as label -100: no loss and not counted in the loss normaliser. A band with
both bounds null is off; with every band off (or no ``rollout_is`` section at all) only the
metrics are computed: the trainer reports them every step. Tokens without a
rollout log-prob are left alone (weight 1, kept) and are not part of the metrics.

Metrics (``mismatch/*``, means over tokens with a rollout log-prob unless said otherwise; the KL
estimates are of KL(rollout || training) on the rollout's samples)::

    kl                 mean(rollout - old)                         k1 estimate
    k3_kl              mean(exp(old - rollout) - 1 - (old - rollout))
    logprob_abs_diff   mean |old - rollout|; logprob_abs_diff_max: its largest token
    log_ppl_diff       per sequence: log ppl(training) - log ppl(rollout) = mean_t(rollout - old),
                       then mean over sequences; also _abs, _max, _min
    ppl_ratio          mean over sequences of ppl(training) / ppl(rollout)
    training_ppl, rollout_ppl   mean over sequences of exp(-mean logprob)
    is_mean, is_max, is_min     raw weights w (before truncation / masking)
    ess                effective sample size of the raw weights, mean(w)^2 / mean(w^2), in (0, 1]
    masked_frac        fraction of tokens dropped (by the mask band or a veto)
    truncated_frac     fraction of tokens whose weight truncation changed
    veto_frac          fraction of sequences vetoed
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rlcli.config import RolloutISConfig

LOG_RATIO_CLAMP = 20.0
ESS_SQ_KEY = "mismatch/_is_sq_mean"  # mean(w^2): combined with is_mean into `ess` after the global reduction


def _active(band: tuple[float | None, float | None]) -> bool:
    return band[0] is not None or band[1] is not None


def truncates(cfg: RolloutISConfig) -> bool:
    return cfg.mode in ("truncate", "both") and _active(cfg.bands()["threshold"])


def masks(cfg: RolloutISConfig) -> bool:
    return cfg.mode in ("mask", "both") and _active(cfg.bands()["mask"])


def vetoes(cfg: RolloutISConfig) -> bool:
    lo, hi = cfg.bands()["veto"]
    return (lo is not None and lo > 0) or hi is not None


def can_reject(cfg: RolloutISConfig | None) -> bool:
    """Whether the correction may drop tokens (then the loss normaliser depends on it)."""
    return cfg is not None and (masks(cfg) or vetoes(cfg))


@dataclass
class RolloutCorrection:
    """The correction of one batch of tokens and its metric contributions."""

    weight: torch.Tensor | None  # [N] float32 factor on each token's loss weight; None: no weighting
    keep: torch.Tensor | None  # [N] bool, False = dropped (label -100); None: nothing can be dropped
    sums: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # mean metrics: (sum, count)
    maxes: dict[str, torch.Tensor] = field(default_factory=dict)
    mins: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class _Tokens:
    """The tokens of one batch as ``rollout_correction`` needs them (float64, invalid ones zeroed)."""

    valid: torch.Tensor  # bool: tokens that have a rollout log-prob
    old: torch.Tensor
    rollout: torch.Tensor
    seq_ids: torch.Tensor
    num_seqs: int

    @property
    def delta(self) -> torch.Tensor:  # log(training / rollout) per token
        return self.old - self.rollout

    def per_seq(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.num_seqs, dtype=torch.float64, device=x.device).index_add_(0, self.seq_ids, x)


def rollout_correction(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    valid: torch.Tensor,
    seq_ids: torch.Tensor,
    num_seqs: int,
    cfg: RolloutISConfig,
) -> RolloutCorrection:
    """IS weights, dropped tokens and ``mismatch/*`` metric sums for ``N`` tokens of ``num_seqs`` sequences.

    ``old_logp``: trainer log-probs before the update (no gradient needed); ``rollout_logp``: the
    engine's; ``valid``: bool, tokens that have a rollout log-prob; ``seq_ids``: ``0..num_seqs-1``,
    the sequence of each token (a sequence's tokens are all in this batch). No host sync.
    """
    valid = valid.bool()
    t = _Tokens(valid, torch.where(valid, old_logp.detach().double(), 0.0),
                torch.where(valid, rollout_logp.double(), 0.0), seq_ids, num_seqs)
    raw = _is_ratio(t, cfg.level)
    dropped, vetoed_seq = _rejections(t, raw, cfg)
    weight, truncated = _weights(t, raw, dropped, cfg)
    keep = ~dropped if can_reject(cfg) else None
    return RolloutCorrection(weight, keep, *_metrics(t, raw, dropped, truncated, vetoed_seq))


def _is_ratio(t: _Tokens, level: str) -> torch.Tensor:
    """The importance ratio training / rollout of each token, at the token, sequence or geometric level."""
    delta = t.delta
    if level == "token":
        x = delta
    elif level == "sequence":
        x = t.per_seq(delta)[t.seq_ids]
    else:
        x = (t.per_seq(delta) / t.per_seq(t.valid.double()).clamp(min=1))[t.seq_ids]
    return torch.exp(x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _rejections(t: _Tokens, raw: torch.Tensor, cfg: RolloutISConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens dropped by the mask band or by their sequence's veto, and the vetoed sequences."""
    bands = cfg.bands()
    dropped = torch.zeros_like(t.valid)
    if masks(cfg):
        lo, hi = bands["mask"]
        inside = torch.ones_like(t.valid)
        if lo is not None:
            inside &= raw >= lo
        if hi is not None:
            inside &= raw <= hi
        dropped |= t.valid & ~inside  # a NaN weight is outside every band
    vetoed_seq = torch.zeros(t.num_seqs, dtype=torch.bool, device=raw.device)
    if vetoes(cfg):
        lo, hi = bands["veto"]
        delta = t.delta
        bad = torch.zeros_like(t.valid)
        if lo is not None and lo > 0:
            bad |= delta < math.log(lo)
        if hi is not None:
            bad |= delta > math.log(hi)
        vetoed_seq = t.per_seq((bad & t.valid).double()) > 0
        dropped |= vetoed_seq[t.seq_ids]
    return dropped, vetoed_seq


def _weights(t: _Tokens, raw: torch.Tensor, dropped: torch.Tensor,
             cfg: RolloutISConfig) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The loss weight of each token (None when nothing reweights) and the tokens whose weight was clipped."""
    truncated = torch.zeros_like(t.valid)
    if not (truncates(cfg) or masks(cfg)):
        return None, truncated
    w = raw
    if truncates(cfg):
        lo, hi = cfg.bands()["threshold"]
        w = w.clamp(min=lo, max=hi)
        truncated = t.valid & ~dropped & (w != raw)
    return torch.where(t.valid, w, 1.0).float(), truncated


def _metrics(t: _Tokens, raw: torch.Tensor, dropped: torch.Tensor, truncated: torch.Tensor,
             vetoed_seq: torch.Tensor) -> tuple[dict, dict, dict]:
    """``mismatch/*`` as (sum, count) pairs, maxima and minima, reduced across ranks by the caller."""
    valid, delta = t.valid, t.delta
    seq_n = t.per_seq(valid.double())
    seq_has, seq_nc = seq_n > 0, seq_n.clamp(min=1)
    n_tok, n_seq = valid.double().sum(), seq_has.double().sum()
    seq_mean_old, seq_mean_rollout = t.per_seq(t.old) / seq_nc, t.per_seq(t.rollout) / seq_nc
    dc = delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rv = torch.where(valid, raw, 0.0)

    def tok(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.where(valid, v, 0.0).sum(), n_tok

    def seq(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.where(seq_has, v, 0.0).sum(), n_seq

    log_ppl_diff = seq_mean_rollout - seq_mean_old  # log ppl(training) - log ppl(rollout)
    sums = {
        "mismatch/kl": tok(-delta),
        "mismatch/k3_kl": tok(torch.exp(dc) - 1.0 - dc),
        "mismatch/logprob_abs_diff": tok(delta.abs()),
        "mismatch/log_ppl_diff": seq(log_ppl_diff),
        "mismatch/log_ppl_abs_diff": seq(log_ppl_diff.abs()),
        "mismatch/ppl_ratio": seq(torch.exp(log_ppl_diff)),
        "mismatch/training_ppl": seq(torch.exp(-seq_mean_old)),
        "mismatch/rollout_ppl": seq(torch.exp(-seq_mean_rollout)),
        "mismatch/is_mean": (rv.sum(), n_tok),
        ESS_SQ_KEY: ((rv * rv).sum(), n_tok),
        "mismatch/masked_frac": tok((dropped & valid).double()),
        "mismatch/truncated_frac": tok(truncated.double()),
        "mismatch/veto_frac": seq((vetoed_seq & seq_has).double()),
    }
    f64 = dict(dtype=torch.float64, device=raw.device)
    neg, pos = torch.tensor(-math.inf, **f64), torch.tensor(math.inf, **f64)
    has_tok, has_seq = raw.numel() > 0, t.num_seqs > 0
    maxes = {
        "mismatch/is_max": torch.where(valid, raw, neg).max() if has_tok else neg,
        "mismatch/logprob_abs_diff_max": torch.where(valid, delta.abs(), neg).max() if has_tok else neg,
        "mismatch/log_ppl_diff_max": torch.where(seq_has, log_ppl_diff, neg).max() if has_seq else neg,
    }
    mins = {
        "mismatch/is_min": torch.where(valid, raw, pos).min() if has_tok else pos,
        "mismatch/log_ppl_diff_min": torch.where(seq_has, log_ppl_diff, pos).min() if has_seq else pos,
    }
    return sums, maxes, mins


def finalize_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Turn the reduced ``mismatch/_is_sq_mean`` into ``mismatch/ess`` (in place; returns ``metrics``)."""
    sq = metrics.pop(ESS_SQ_KEY, None)
    if sq is not None:
        mean = metrics.get("mismatch/is_mean", 0.0)
        metrics["mismatch/ess"] = mean * mean / sq if sq > 0 else 0.0
    return metrics
