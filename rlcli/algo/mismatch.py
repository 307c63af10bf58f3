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
    dev = old_logp.device
    f64 = dict(dtype=torch.float64, device=dev)
    valid = valid.bool()
    validf = valid.double()
    old = torch.where(valid, old_logp.detach().double(), 0.0)
    rollout = torch.where(valid, rollout_logp.double(), 0.0)
    delta = old - rollout  # log(training / rollout) per token

    def per_seq(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(num_seqs, **f64).index_add_(0, seq_ids, x)

    seq_n = per_seq(validf)
    seq_has = seq_n > 0
    seq_nc = seq_n.clamp(min=1)
    seq_delta = per_seq(delta)
    if cfg.level == "token":
        x = delta
    elif cfg.level == "sequence":
        x = seq_delta[seq_ids]
    else:
        x = (seq_delta / seq_nc)[seq_ids]
    raw = torch.exp(x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))

    bands = cfg.bands()
    dropped = torch.zeros_like(valid)
    if masks(cfg):
        lo, hi = bands["mask"]
        inside = torch.ones_like(valid)
        if lo is not None:
            inside &= raw >= lo
        if hi is not None:
            inside &= raw <= hi
        dropped |= valid & ~inside  # a NaN weight is outside every band
    vetoed_seq = torch.zeros(num_seqs, dtype=torch.bool, device=dev)
    if vetoes(cfg):
        lo, hi = bands["veto"]
        bad = torch.zeros_like(valid)
        if lo is not None and lo > 0:
            bad |= delta < math.log(lo)
        if hi is not None:
            bad |= delta > math.log(hi)
        vetoed_seq = per_seq((bad & valid).double()) > 0
        dropped |= vetoed_seq[seq_ids]
    keep = ~dropped if can_reject(cfg) else None

    weight = None
    truncated = torch.zeros_like(valid)
    if truncates(cfg) or masks(cfg):
        w = raw
        if truncates(cfg):
            lo, hi = bands["threshold"]
            w = w.clamp(min=lo, max=hi)
            truncated = valid & ~dropped & (w != raw)
        weight = torch.where(valid, w, 1.0).float()

    n_tok = validf.sum()
    n_seq = seq_has.double().sum()
    seq_mean_old, seq_mean_rollout = per_seq(old) / seq_nc, per_seq(rollout) / seq_nc
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
    neg, pos = torch.tensor(-math.inf, **f64), torch.tensor(math.inf, **f64)
    maxes = {
        "mismatch/is_max": torch.where(valid, raw, neg).max() if raw.numel() else neg,
        "mismatch/logprob_abs_diff_max": torch.where(valid, delta.abs(), neg).max() if raw.numel() else neg,
        "mismatch/log_ppl_diff_max": torch.where(seq_has, log_ppl_diff, neg).max() if num_seqs else neg,
    }
    mins = {
        "mismatch/is_min": torch.where(valid, raw, pos).min() if raw.numel() else pos,
        "mismatch/log_ppl_diff_min": torch.where(seq_has, log_ppl_diff, pos).min() if num_seqs else pos,
    }
    return RolloutCorrection(weight, keep, sums, maxes, mins)


def finalize_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Turn the reduced ``mismatch/_is_sq_mean`` into ``mismatch/ess`` (in place; returns ``metrics``)."""
    sq = metrics.pop(ESS_SQ_KEY, None)
    if sq is not None:
        mean = metrics.get("mismatch/is_mean", 0.0)
        metrics["mismatch/ess"] = mean * mean / sq if sq > 0 else 0.0
    return metrics
