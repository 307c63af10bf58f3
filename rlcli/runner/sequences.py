"""A step's groups -> training sequences: per-group advantages on every completed sample."""

from __future__ import annotations

from rlcli.component import ComputesGroups
from rlcli.types import Group, Status


def sequences_from_groups(groups: list[Group], estimator):
    """Per-group advantages -> training sequences (FAILED members are left out)."""
    from rlcli.algo.advantage import AdvantageEstimator
    from rlcli.train.data import TrainSequence

    seqs: list[TrainSequence] = []
    adv_values: list[float] = []
    kept = [m for m in ([s for s in g.samples if s.status == Status.COMPLETED and s.reward is not None
                          and s.response_ids] for g in groups) if m]
    rewards = [[s.score for s in members] for members in kept]
    lengths = [[len(s.response_ids) for s in members] for members in kept]
    if isinstance(estimator, ComputesGroups):  # every group at once
        advantages = estimator.compute_groups(rewards, lengths)
    else:  # an estimator with the per-group method only: the base class's loop over it
        advantages = AdvantageEstimator.compute_groups(estimator, rewards, lengths)
    for members, adv in zip(kept, advantages):
        for s, a in zip(members, adv):
            seqs.append(TrainSequence(
                prompt_ids=s.prompt_ids, response_ids=s.response_ids,
                response_mask=s.response_mask or [1] * len(s.response_ids),
                rollout_logprobs=s.logprobs, advantage=float(a), temperature=s.temperature, seq_id=s.uid,
            ))
            adv_values.append(float(a))
    return seqs, adv_values
