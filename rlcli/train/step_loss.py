"""The loss of one micro-batch in a train step, and the pieces it is made of.

Over the tokens that rollout IS kept (:func:`correction`), the policy loss with the aggregation
weights of the mini-batch (normalised by the kept tokens and sequences on all ranks:
:func:`kept_counts`) times the IS weights, minus the entropy bonus, plus the KL penalty
(:func:`micro_batch_loss`). With ``head_grad_in_forward``, when the loss's gradient with respect to
every logprob is known before the forward pass (:func:`head_grad_ahead`), :func:`on_policy_grad`
gives it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rlcli.algo.kl import kl_penalty
from rlcli.algo.loss import aggregation_weights
from rlcli.algo.mismatch import RolloutCorrection, masks, rollout_correction, truncates, vetoes
from rlcli.component import RatioOnly
from rlcli.config import RolloutISConfig
from rlcli.train.data import MicroBatch
from rlcli.train.step_metrics import StepMetrics

if TYPE_CHECKING:
    from rlcli.algo.loss import PolicyLoss
    from rlcli.config import TrainWorkerConfig

#: ``rollout_is`` when the recipe sets none: the ``mismatch/*`` metrics, no weighting, nothing dropped.
METRICS_ONLY = RolloutISConfig()


def correction(mb: MicroBatch, old_logp: torch.Tensor, is_cfg: RolloutISConfig | None,
               m: StepMetrics) -> RolloutCorrection:
    """Rollout IS of ``mb`` from its old and rollout logprobs; adds the ``mismatch/*`` metrics to ``m``."""
    c = rollout_correction(old_logp, mb.rollout_logprobs, mb.has_rollout_logprobs, mb.seq_local,
                           len(mb.seq_indices), is_cfg or METRICS_ONLY)
    for name, (total, count) in c.sums.items():
        m.add_sum(name, total, count)
    for name, value in {**c.maxes, **c.mins}.items():
        m.add_extreme(name, value)
    return c


def kept_counts(batches: list[list[MicroBatch]], corr: list[list[RolloutCorrection]],
                device: torch.device) -> tuple[list[float], list[float]]:
    """Per mini-batch: tokens and sequences (with at least one token) that rollout IS kept; one host sync."""
    rows = []
    for mbs, cs in zip(batches, corr):
        toks = torch.zeros((), dtype=torch.float64, device=device)
        nseq = torch.zeros((), dtype=torch.float64, device=device)
        for mb, c in zip(mbs, cs):
            keep = c.keep.double()
            toks = toks + keep.sum()
            per_seq = torch.zeros(len(mb.seq_indices), dtype=torch.float64, device=device)
            nseq = nseq + (per_seq.index_add_(0, mb.seq_local, keep) > 0).double().sum()
        rows.append(torch.stack([toks, nseq]))
    counts = torch.stack(rows).tolist() if rows else []
    return [t for t, _ in counts], [n for _, n in counts]


def loss_weights(policy_loss: PolicyLoss, mb: MicroBatch, mask: torch.Tensor, num_tokens: int,
                 num_seqs: int) -> torch.Tensor:
    """The aggregation weight of every label of ``mb`` (0 where ``mask`` is False) for the
    mini-batch's global counts: the policy loss's ``loss_agg`` and ``loss_scale_factor``. The one
    place both the ordinary path and :func:`on_policy_grad` take them from."""
    return aggregation_weights(policy_loss.loss_agg, mask, mb.seq_local, num_tokens, num_seqs,
                               num_local_seqs=len(mb.seq_indices), scale_factor=policy_loss.loss_scale_factor)


def micro_batch_loss(cfg: TrainWorkerConfig, policy_loss: PolicyLoss, mb: MicroBatch, logp: torch.Tensor,
                     old_logp: torch.Tensor, ent: torch.Tensor, c: RolloutCorrection, ref_logp: torch.Tensor | None,
                     counts: tuple[int, int], m: StepMetrics) -> tuple[torch.Tensor, dict[str, Any], Any]:
    """``(loss, the policy loss's metrics, kept tokens)`` of one micro-batch: the policy loss over
    the tokens rollout IS kept, with the aggregation weights for the mini-batch's global ``counts``
    (tokens, sequences) times the IS weights, minus the entropy bonus, plus the KL penalty against
    ``ref_logp`` (whose metric it adds to ``m``)."""
    num_tokens, num_seqs = counts
    if c is not None and c.keep is not None:
        mask, n_kept = c.keep, c.keep.sum()
    else:
        mask, n_kept = torch.ones_like(mb.labels, dtype=torch.bool), mb.num_labels
    # Ahead, the loss is evaluated here again, at the real logprobs (its gradient came from
    # the evaluation at 0): its value and metrics are the reported ones, and a non-finite
    # logprob still makes it non-finite and skips the update, as on the ordinary path.
    tok_loss, metrics = policy_loss.per_token_loss(logp, old_logp, mb.advantages, mask, mb.seq_local)
    w = loss_weights(policy_loss, mb, mask, num_tokens, num_seqs)
    loss = (tok_loss * (w * c.weight if c is not None and c.weight is not None else w)).sum()
    if cfg.entropy_coef > 0:  # the bonus, weighted like the policy term (masked tokens: 0)
        loss = loss - cfg.entropy_coef * (ent * w).sum()
    if ref_logp is not None:
        kl = torch.where(mask, kl_penalty(logp, ref_logp, cfg.kl.type), 0.0)
        loss = loss + cfg.kl.coef * (kl * w).sum()
        m.add_sum("kl_ref", kl.detach().sum(), n_kept)
    return loss, metrics, n_kept


def head_grad_ahead(cfg: TrainWorkerConfig, policy_loss: PolicyLoss) -> bool:
    """Whether every token's loss gradient is known before the forward pass, so that the LM
    head's gradient can be computed while its logits are at hand (``head_grad_in_forward``).

    It is when the update is the batch's first and only one (the old logprobs are the
    current ones, detached: the ratio is exactly 1), the loss depends on the logprobs only
    through ``logp - old_logp`` (:attr:`PolicyLoss.ratio_only`), and nothing else in the
    loss reads the logprobs' values: no KL penalty, no entropy bonus, and rollout IS neither
    weights nor drops tokens (a metrics-only ``rollout_is: {}`` is fine)."""
    is_cfg = cfg.rollout_is
    if not cfg.head_grad_in_forward or cfg.optimizer_steps != 1 or cfg.kl.coef > 0 or cfg.entropy_coef > 0:
        return False
    if is_cfg is not None and (truncates(is_cfg) or masks(is_cfg) or vetoes(is_cfg)):
        return False
    return isinstance(policy_loss, RatioOnly) and bool(policy_loss.ratio_only)


def on_policy_grad(policy_loss: PolicyLoss, mb: MicroBatch, num_tokens: int, num_seqs: int, world_size: int,
                   device: torch.device) -> torch.Tensor:
    """d(loss of ``mb``, scaled as its backward pass would be)/d logprob, per label, at ratio 1.

    The policy loss is evaluated at ``logp = old_logp = 0``: for a ratio-only loss every
    intermediate equals its value at the real logprobs (``logp - old_logp`` is exactly 0 in
    both), so the gradient is the one the ordinary backward pass would bring to the head."""
    z = torch.zeros(mb.labels.shape, dtype=torch.float32, device=device, requires_grad=True)
    mask = torch.ones_like(mb.labels, dtype=torch.bool)
    with torch.enable_grad():
        tok_loss, _ = policy_loss.per_token_loss(z, z.detach(), mb.advantages, mask, mb.seq_local)
        loss = (tok_loss * loss_weights(policy_loss, mb, mask, num_tokens, num_seqs)).sum()
        (g,) = torch.autograd.grad(loss * world_size if world_size > 1 else loss, z, allow_unused=True)
    return torch.zeros_like(z) if g is None else g.detach()
