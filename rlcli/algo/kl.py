"""KL penalty to a frozen reference model: per-token estimators of KL(policy || reference).

The tokens were sampled by (approximately) the policy, so a per-token function of the policy's
log-prob ``logp`` and the reference's ``ref`` of the sampled token estimates the KL; its mean
over the batch is the estimate, and its gradient with respect to ``logp`` is what the loss
uses. Estimators (``d = ref - logp``; XTuner/verl names)::

    k1                logp - ref                              unbiased, high variance, can be < 0
    k2                (logp - ref)^2 / 2                      biased, low variance, >= 0
    abs               |logp - ref|
    k3 = low_var_kl   exp(d) - d - 1, d clamped to [-20, 20],  unbiased, >= 0, low variance
                      the value clamped to [-10, 10]

The train worker (see ``train_worker.kl``) adds ``coef × kl`` per token to the loss with the
policy loss's token weights, so the KL term is normalised exactly like the policy term.
"""

from __future__ import annotations

import torch

KL_TYPES: tuple[str, ...] = ("k1", "k2", "k3", "low_var_kl", "abs")

LOW_VAR_KL_DIFF_CLAMP = 20.0  # |ref - logp| before exp()
LOW_VAR_KL_VALUE_CLAMP = 10.0  # |estimate|


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate of kind ``kind`` (one of :data:`KL_TYPES`).

    ``logp``, ``ref_logp``: ``[N]`` log-probs of the sampled tokens under the policy (may carry a
    gradient) and the frozen reference. Returns ``[N]`` in the dtype of ``logp``.
    """
    if kind == "k1":
        return logp - ref_logp
    if kind == "k2":
        return 0.5 * (logp - ref_logp).square()
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind in ("k3", "low_var_kl"):
        d = (ref_logp - logp).clamp(-LOW_VAR_KL_DIFF_CLAMP, LOW_VAR_KL_DIFF_CLAMP)
        return (torch.exp(d) - d - 1.0).clamp(-LOW_VAR_KL_VALUE_CLAMP, LOW_VAR_KL_VALUE_CLAMP)
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {', '.join(KL_TYPES)}")
