"""A step's groups -> training sequences: per-group advantages on every completed sample.

Every judged COMPLETED sample counts in its group's advantages; one whose reward asks for it
(``exclude_from_loss``, e.g. a truncated response under the ``overlong`` judger's
``exclude_truncated``) then becomes no training sequence.
"""

from __future__ import annotations

import logging

from rlcli.component import ComputesGroups
from rlcli.types import Group, Sample, Status

log = logging.getLogger(__name__)


def _out_of_vocab(s: Sample, vocab_size: int | None) -> bool:
    """Whether ``s`` holds a token id the model has no embedding for (an agent loop's or backend's bug)."""
    if vocab_size is None:
        return False
    top = max(max(s.prompt_ids, default=0), max(s.response_ids, default=0))
    if top < vocab_size:
        return False
    s.status, s.reward = Status.FAILED, None
    s.error = f"token id {top} is beyond the model's vocabulary ({vocab_size} ids)"
    log.warning("sample uid=%s of task %r left out of training: %s", s.uid, s.task_name, s.error)
    return True


def sequences_from_groups(groups: list[Group], estimator, vocab_size: int | None = None):
    """Per-group advantages -> training sequences (FAILED members are left out; members excluded
    from the loss count in their group's advantages only). ``vocab_size``: the model's; a member
    holding a larger token id is made FAILED and left out (it would end the train step)."""
    from rlcli.algo.advantage import AdvantageEstimator
    from rlcli.train.data import TrainSequence

    seqs: list[TrainSequence] = []
    adv_values: list[float] = []
    kept = [m for m in ([s for s in g.samples if s.status == Status.COMPLETED and s.reward is not None
                          and s.response_ids and not _out_of_vocab(s, vocab_size)] for g in groups) if m]
    rewards = [[s.score for s in members] for members in kept]
    lengths = [[len(s.response_ids) for s in members] for members in kept]
    if isinstance(estimator, ComputesGroups):  # every group at once
        advantages = estimator.compute_groups(rewards, lengths)
    else:  # an estimator with the per-group method only: the base class's loop over it
        advantages = AdvantageEstimator.compute_groups(estimator, rewards, lengths)
    for members, adv in zip(kept, advantages):
        for s, a in zip(members, adv):
            if s.excluded_from_loss:
                continue
            seqs.append(TrainSequence(
                prompt_ids=s.prompt_ids, response_ids=s.response_ids,
                response_mask=s.response_mask or [1] * len(s.response_ids),
                rollout_logprobs=s.logprobs or None,  # none when the engine skipped them (return_logprob false)
                advantage=float(a), temperature=s.temperature, seq_id=s.uid,
            ))
            adv_values.append(float(a))
    return seqs, adv_values
