"""Policy losses: per-token PPO-style losses from new/old log-probs and advantages.

A loss is a registered component of kind ``policy_loss``. Its one job is
:meth:`PolicyLoss.per_token_loss`, which returns the *unweighted* loss of every token plus
detached metrics; the train worker owns aggregation, because the normaliser (valid tokens or
sequences in the whole optimizer step, across every rank) is only known there.
:func:`aggregation_weights` turns a loss's ``loss_agg`` (and, for ``seq-mean-token-sum-norm``, its
``loss_scale_factor``) into per-token weights.

Metric convention (what the worker relies on): every metric is a 0-d tensor reduced over the
valid tokens passed in. Names ending in ``_max`` / ``_min`` are extremes (an empty input gives
``-inf`` / ``+inf``, the identities of the reduction); every other metric is a mean over valid
tokens (0 for an empty input), which the worker re-weights by the number of valid tokens.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, model_validator

from rlcli import hookimpl
from rlcli.component import Component, ComponentConfig

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
LOSS_AGGS: tuple[str, ...] = LossAgg.__args__  # type: ignore[attr-defined]

#: The modes, as the option descriptions state them (``w_t``: the weight of token ``t``).
LOSS_AGG_HELP = (
    "How the per-token losses of an optimizer step (all ranks) are combined, as each kept token's weight: "
    "token-mean 1/(kept tokens); seq-mean-token-mean 1/(kept tokens of its sequence * sequences); "
    "seq-mean-token-sum 1/sequences (each sequence's token sum, averaged; verl's); seq-mean-token-sum-norm "
    "1/(sequences * loss_scale_factor) (Dr. GRPO's constant normaliser). Sequences count when they have a "
    "kept token; a fully masked one weighs nothing and counts nowhere. The step's loss does not depend on "
    "how it is split into micro-batches, packs or ranks."
)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    n = mask.sum()
    return torch.where(mask, x, 0.0).sum() / n.clamp(min=1)


# No host synchronisation in these reductions: the worker runs many micro-batches back to back.
def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:
        return torch.tensor(float("-inf"), device=x.device)
    return torch.where(mask, x, float("-inf")).max()


def masked_min(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:
        return torch.tensor(float("inf"), device=x.device)
    return torch.where(mask, x, float("inf")).min()


def aggregation_weights(
    loss_agg: str,
    mask: torch.Tensor,
    seq_ids: torch.Tensor | None,
    num_tokens: int,
    num_seqs: int,
    num_local_seqs: int | None = None,
    scale_factor: float | None = None,
) -> torch.Tensor:
    """Per-token weights whose dot product with the per-token loss is this batch's share of the step loss.

    ``num_tokens`` / ``num_seqs``: valid tokens / sequences with at least one valid token in the
    whole optimizer step on all ranks. ``token-mean`` weighs every valid token
    ``1/num_tokens``; ``seq-mean-token-mean`` averages tokens within each sequence, then
    sequences (``1/(tokens of its sequence · num_seqs)``); ``seq-mean-token-sum`` sums tokens
    within each sequence, then averages sequences (``1/num_seqs``); ``seq-mean-token-sum-norm``
    also divides by the constant ``scale_factor`` (``1/(num_seqs · scale_factor)``, Dr. GRPO's).
    Every weight depends only on global counts and on the token's own sequence, which a pack
    holds whole, so the step loss is the same however the step is split. Masked tokens weigh 0;
    a step with nothing to train on gives all-zero weights (never a division by zero).
    ``num_local_seqs``: when given, ``seq_ids`` are already ``0..num_local_seqs-1`` (no host
    synchronisation).
    """
    maskf = mask.to(torch.float32)
    if loss_agg == "token-mean":
        return maskf / max(num_tokens, 1)
    if loss_agg == "seq-mean-token-sum":
        return maskf / max(num_seqs, 1)
    if loss_agg == "seq-mean-token-sum-norm":
        if scale_factor is None or not scale_factor > 0:
            raise ValueError("loss_agg 'seq-mean-token-sum-norm' needs a positive loss_scale_factor, "
                             f"got {scale_factor!r}")
        return maskf / (max(num_seqs, 1) * float(scale_factor))
    if loss_agg == "seq-mean-token-mean":
        if seq_ids is None:
            raise ValueError("loss_agg 'seq-mean-token-mean' needs seq_ids")
        if num_local_seqs is None:
            _, seq_ids = torch.unique(seq_ids, return_inverse=True)
            num_local_seqs = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
        per_seq = torch.zeros(num_local_seqs, device=mask.device).index_add_(0, seq_ids, maskf)
        return maskf / (per_seq[seq_ids].clamp(min=1) * max(num_seqs, 1))
    raise ValueError(f"unknown loss_agg {loss_agg!r}; expected one of {', '.join(LOSS_AGGS)}")


def _ratio_metrics(log_ratio: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": masked_max(ratio, mask),
        "ratio_min": masked_min(ratio, mask),
        # KL(old || new) estimated on samples of the old policy: k1 = log(old/new), k3 = r - 1 - log r.
        "kl_k1": masked_mean(-log_ratio, mask),
        "kl_k3": masked_mean(ratio - 1.0 - log_ratio, mask),
    }


class PolicyLoss(Component):
    """Base class: per-token policy loss; the worker weights and sums it."""

    #: True when the loss (and its metrics) depend on ``logp`` and ``old_logp`` only through
    #: ``logp - old_logp``, as PPO-style ratio losses do. With one optimizer step per batch
    #: (``old_logp`` is ``logp`` detached) the trainer then knows every token's gradient before
    #: the forward pass and computes the LM head's gradient without projecting the logits twice
    #: (``train_worker.head_grad_in_forward``). Leave it False unless that holds.
    ratio_only: ClassVar[bool] = False

    @property
    def loss_agg(self) -> str:
        return getattr(self.config, "loss_agg", "token-mean")

    @property
    def loss_scale_factor(self) -> float | None:
        """The constant of ``seq-mean-token-sum-norm`` (None when the config has none)."""
        return getattr(self.config, "loss_scale_factor", None)

    def per_token_loss(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        adv: torch.Tensor,
        mask: torch.Tensor,
        seq_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """All inputs are ``[N]`` over the same tokens; ``mask`` is bool (True = trained on).

        Returns the per-token loss (0 where ``mask`` is False, even if inputs there are NaN) and
        detached metrics (see the module docstring).
        """
        raise NotImplementedError


_CLIPFRAC_HELP = (
    "train/clipfrac counts the kept tokens whose ratio lies outside [1 - clip_low, 1 + clip_high] "
    "(XTuner's clip_frac_low + clip_frac_high), whatever the advantage's sign; verl's pg_clipfrac counts "
    "only the tokens where the clipped term is the one taken (the clip is active), so it reads lower."
)


def _scale_factor_field() -> Any:
    return Field(
        None, gt=0, description="seq-mean-token-sum-norm only: the constant every sequence's token sum is divided "
        "by (Dr. GRPO's normaliser, verl's loss_scale_factor). Null: the largest "
        "agent_loop.sample_params.max_tokens of the training tasks, fixed when the recipe is loaded (verl's "
        "default is its padded response length, the same maximum); resolved.yaml shows the value used.")


class _ClipConfig(ComponentConfig):
    log_prob_diff_min: float = Field(-20.0, description="Lower clamp of logp - old_logp before exp().")
    log_prob_diff_max: float = Field(20.0, description="Upper clamp of logp - old_logp before exp().")

    @model_validator(mode="after")
    def _check_clamp(self):
        if self.log_prob_diff_min >= self.log_prob_diff_max:
            raise ValueError(
                f"log_prob_diff_min={self.log_prob_diff_min} must be < log_prob_diff_max={self.log_prob_diff_max}"
            )
        agg = getattr(self, "loss_agg", None)
        if getattr(self, "loss_scale_factor", None) is not None and agg != "seq-mean-token-sum-norm":
            raise ValueError(f"loss_scale_factor only applies to loss_agg 'seq-mean-token-sum-norm' (loss_agg is "
                             f"{agg!r}): remove it, or set loss_agg: seq-mean-token-sum-norm")
        return self


class VanillaPolicyLoss(PolicyLoss):
    """PPO-clip with asymmetric clip range and dual clip (XTuner/verl 'vanilla')."""

    name: ClassVar[str] = "vanilla"
    ratio_only: ClassVar[bool] = True

    class Config(_ClipConfig):
        clip_low: float = Field(0.2, ge=0, lt=1,
                                description="Ratio clipped below at 1 - clip_low. " + _CLIPFRAC_HELP)
        clip_high: float = Field(0.28, ge=0, description="Ratio clipped above at 1 + clip_high.")
        clip_ratio_c: float | None = Field(
            3.0, gt=1, description="Dual clip: loss of negative-advantage tokens capped at -A*c; null disables it."
        )
        loss_agg: LossAgg = Field("token-mean", description=LOSS_AGG_HELP)
        loss_scale_factor: float | None = _scale_factor_field()

    def per_token_loss(self, logp, old_logp, adv, mask, seq_ids=None):
        cfg = self.config
        mask = mask.bool()
        log_ratio = (logp - old_logp).clamp(cfg.log_prob_diff_min, cfg.log_prob_diff_max)
        ratio = torch.exp(log_ratio)
        clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        loss = torch.maximum(-adv * ratio, -adv * clipped)
        metrics: dict[str, torch.Tensor] = {}
        if cfg.clip_ratio_c is not None:
            cap = -adv * cfg.clip_ratio_c
            dual = (adv < 0) & (loss > cap)
            loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
            metrics["clipfrac_dual"] = masked_mean(dual.float(), mask)
        loss = torch.where(mask, loss, 0.0)
        with torch.no_grad():
            r, lr = ratio.detach(), log_ratio.detach()
            low = (r < 1.0 - cfg.clip_low).float()
            high = (r > 1.0 + cfg.clip_high).float()
            metrics.update(
                clipfrac_low=masked_mean(low, mask),
                clipfrac_high=masked_mean(high, mask),
                clipfrac=masked_mean(low + high, mask),
                **_ratio_metrics(lr, r, mask),
            )
            metrics = {k: v.detach() for k, v in metrics.items()}
        return loss, metrics


class GSPOPolicyLoss(PolicyLoss):
    """GSPO: PPO-clip on the per-sequence geometric-mean ratio (Zheng et al., 2025)."""

    name: ClassVar[str] = "gspo"
    ratio_only: ClassVar[bool] = True

    class Config(_ClipConfig):
        log_prob_diff_min: float = Field(-20.0, description="Lower clamp of the sequence log-ratio (the mean of "
                                         "logp - old_logp over the sequence) before exp().")
        log_prob_diff_max: float = Field(20.0, description="Upper clamp of the sequence log-ratio before exp(). "
                                         "verl clamps it at 10 (above only): set 10 for verl's value.")
        clip_low: float = Field(3e-4, ge=0, lt=1, description="Sequence ratio clipped below at 1 - clip_low. "
                                + _CLIPFRAC_HELP)
        clip_high: float = Field(4e-4, ge=0, description="Sequence ratio clipped above at 1 + clip_high.")
        loss_agg: LossAgg = Field(
            "seq-mean-token-mean", description="GSPO's objective is a mean over sequences of token means "
            "(seq-mean-token-mean); the other modes are those of the vanilla loss."
        )
        loss_scale_factor: float | None = _scale_factor_field()

    def per_token_loss(self, logp, old_logp, adv, mask, seq_ids=None):
        """GSPO-token form: every token of sequence ``i`` carries ratio ``s_i = exp(mean_t(logp - old))``
        as its value, with the gradient of its own ``logp`` (``sg[s_i] · π/sg[π]``); with a
        sequence-constant advantage this equals sequence-level GSPO."""
        if seq_ids is None:
            raise ValueError("the gspo loss needs seq_ids (which sequence each token belongs to)")
        cfg = self.config
        mask = mask.bool()
        maskf = mask.to(logp.dtype)
        _, inverse = torch.unique(seq_ids, return_inverse=True)
        nseq = int(inverse.max()) + 1 if inverse.numel() else 0
        diff = torch.where(mask, logp.detach() - old_logp, 0.0)
        sums = torch.zeros(nseq, dtype=diff.dtype, device=diff.device).index_add_(0, inverse, diff)
        counts = torch.zeros(nseq, dtype=diff.dtype, device=diff.device).index_add_(0, inverse, maskf)
        seq_log_ratio = (sums / counts.clamp(min=1))[inverse]
        log_ratio = (seq_log_ratio + logp - logp.detach()).clamp(cfg.log_prob_diff_min, cfg.log_prob_diff_max)
        ratio = torch.exp(log_ratio)
        clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        loss = torch.where(mask, torch.maximum(-adv * ratio, -adv * clipped), 0.0)
        with torch.no_grad():
            r = ratio.detach()
            low = (r < 1.0 - cfg.clip_low).float()
            high = (r > 1.0 + cfg.clip_high).float()
            tok_lr = (logp.detach() - old_logp).clamp(cfg.log_prob_diff_min, cfg.log_prob_diff_max)
            metrics = {
                "clipfrac_low": masked_mean(low, mask),
                "clipfrac_high": masked_mean(high, mask),
                "clipfrac": masked_mean(low + high, mask),
                # ratio statistics of the sequence ratio; KL estimates from the token ratios.
                "ratio_mean": masked_mean(r, mask),
                "ratio_max": masked_max(r, mask),
                "ratio_min": masked_min(r, mask),
                "kl_k1": masked_mean(-tok_lr, mask),
                "kl_k3": masked_mean(torch.exp(tok_lr) - 1.0 - tok_lr, mask),
            }
        return loss, metrics


@hookimpl
def register_policy_losses() -> list[type]:
    return [VanillaPolicyLoss, GSPOPolicyLoss]
