"""Staleness: how old rollout data is, and what happens to data past its bound.

Everything is counted in policy versions. The backend stamps each response token with the
version of the weights that produced it (``Sample.token_versions``); version ``s`` is the policy
after training step ``s``. Data made by version ``v`` and consumed at step ``t`` has staleness
``t - v - 1`` (0: made by the weights of step ``t - 1``, on-policy); a sample's staleness is
that of its oldest token.

A task's :class:`StalenessRule` holds its bounds. A strategy sets them in sync windows
(``max_staleness``, ``max_token_staleness``) and :meth:`StalenessRule.from_windows` turns a
bound of ``n`` extra windows into the threshold ``(n + 1) * sync_weights_interval``:

* a sample expires when its staleness reaches ``stale_threshold``, or when every one of its
  tokens is masked (:func:`apply_staleness`, run when the buffer stores or refreshes a group);
* the producer stops when the data it would make for a future step would already be expired
  (:meth:`StalenessRule.model_expired`);
* a token older than ``token_stale_threshold`` is masked (``response_mask`` 0), never dropped
  (:func:`token_keep_mask`; written into the samples of a taken batch by
  :func:`mask_stale_tokens`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rlcli.types import Group, Sample, Status


def seq_staleness(oldest_version: int | None, consumer_step: int) -> int:
    """Staleness at consumer step ``t`` of data whose oldest token came from policy ``v``: ``t - v - 1``."""
    if oldest_version is None:
        return 0
    return consumer_step - oldest_version - 1


@dataclass
class StalenessRule:
    """Per-task expiry settings (all in policy versions)."""

    stale_threshold: int | None = None
    token_stale_threshold: int | None = None
    retryable: bool = True

    @classmethod
    def from_windows(cls, sync_weights_interval: int, max_staleness: int = 0, max_token_staleness: int | None = None,
                     *, retryable: bool) -> "StalenessRule":
        """Bounds in extra sync windows -> thresholds ``(bound + 1) * sync_weights_interval``."""
        i = sync_weights_interval
        return cls(stale_threshold=(max_staleness + 1) * i,
                   token_stale_threshold=None if max_token_staleness is None else (max_token_staleness + 1) * i,
                   retryable=retryable)

    def expired(self, staleness: int) -> bool:
        """Is data this stale past the bound?"""
        return self.stale_threshold is not None and staleness >= self.stale_threshold

    def model_expired(self, future_step: int, model_step: int) -> bool:
        """Would data for ``future_step`` made by policy ``model_step`` already be expired?"""
        return self.expired(seq_staleness(model_step, future_step))


def token_keep_mask(sample: Sample, consumer_step: int, token_threshold: int | None) -> list[int]:
    """Semantic mask AND staleness mask (pure: the sample is not modified)."""
    mask = list(sample.response_mask) if sample.response_mask else [1] * len(sample.response_ids)
    if token_threshold is None:
        return mask
    return [m if seq_staleness(v, consumer_step) < token_threshold else 0
            for m, v in zip(mask, sample.token_versions)]


def mask_stale_tokens(groups: Iterable[Group], consumer_step: int, token_threshold: int | None) -> int:
    """Write the token-staleness mask into the COMPLETED samples of ``groups``; return how many
    tokens it newly masked."""
    if token_threshold is None:
        return 0
    masked = 0
    for g in groups:
        for s in g.samples:
            if s.status != Status.COMPLETED or not s.response_ids:
                continue
            keep = token_keep_mask(s, consumer_step, token_threshold)
            old = s.response_mask or [1] * len(s.response_ids)
            masked += sum(1 for a, b in zip(old, keep) if a and not b)
            s.response_mask = keep
    return masked


def _sample_expired(sample: Sample, consumer_step: int, rule: StalenessRule) -> bool:
    if rule.expired(sample.staleness):
        return True
    return rule.token_stale_threshold is not None and \
        not any(token_keep_mask(sample, consumer_step, rule.token_stale_threshold))


def apply_staleness(group: Group, consumer_step: int, rule: StalenessRule) -> bool:
    """Refresh staleness and expiry of ``group`` at ``consumer_step`` in place; return False if it
    must be discarded.

    An expired group is kept for a re-roll when the rule is ``retryable`` (only its expired
    members are reset; fresh siblings keep their responses), else every member is marked EXPIRED
    and the group is to be discarded.
    """
    if group.status not in (Status.COMPLETED, Status.ABORTED, Status.EXPIRED):
        return True
    expired_any = False
    for s in group.samples:
        s.staleness = seq_staleness(s.oldest_version(), consumer_step)
        if s.status == Status.EXPIRED:
            expired_any = True
            continue
        if not s.response_ids:
            continue
        if _sample_expired(s, consumer_step, rule):
            expired_any = True
            s.status = Status.EXPIRED
    if not expired_any:
        return True
    if not rule.retryable:
        for s in group.samples:
            s.status = Status.EXPIRED
        return False
    for s in group.samples:
        if s.status == Status.EXPIRED:
            s.reset_response()
            s.status = Status.EXPIRED
    return True
