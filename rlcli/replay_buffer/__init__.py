"""Replay buffers: where rollout groups wait between production and training.

The buffer stores whole groups, partitioned by task, each with a status (COMPLETED, ABORTED,
EXPIRED, ...) and a staleness. ``take`` pops COMPLETED groups in the buffer's policy order:

* ``sync``  - FIFO (oldest first).
* ``async`` - highest staleness first, FIFO among equals (consume the data closest to expiry).

Staleness lifecycle (``put`` and ``refresh``), in policy versions: a sample's staleness at
consumer step ``t`` is ``t - oldest_token_version - 1``. A sample expires when its staleness
reaches ``stale_threshold`` or when every one of its tokens is masked by
``token_stale_threshold``. An expired group is either kept for a re-roll (``retryable``: only
its expired members are reset, fresh siblings keep their responses) or discarded. Tokens older
than ``token_stale_threshold`` are masked (``response_mask`` 0), never dropped.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rlcli import hookimpl
from rlcli.component import Component, ComponentConfig
from rlcli.types import Group, Sample, Status, seq_staleness


def token_keep_mask(sample: Sample, consumer_step: int, token_threshold: int | None) -> list[int]:
    """Semantic mask AND staleness mask (pure: the sample is not modified)."""
    mask = list(sample.response_mask) if sample.response_mask else [1] * len(sample.response_ids)
    if token_threshold is None:
        return mask
    return [m if (consumer_step - v - 1) < token_threshold else 0 for m, v in zip(mask, sample.token_versions)]


@dataclass
class StalenessRule:
    """Per-task expiry settings (all in policy versions)."""

    stale_threshold: int | None = None
    token_stale_threshold: int | None = None
    retryable: bool = True


@dataclass
class _Entry:
    group: Group
    seq: int  # insertion order
    status: Status = field(init=False)
    staleness: int = field(init=False)

    def __post_init__(self) -> None:
        self.status = self.group.status
        self.staleness = self.group.staleness


class ReplayBufferConfig(ComponentConfig):
    pass


class ReplayBuffer(Component):
    """FIFO replay buffer (XTuner's SyncReplayBuffer)."""

    name: ClassVar[str] = "sync"
    Config: ClassVar[type[ReplayBufferConfig]] = ReplayBufferConfig

    def __init__(self, config: ReplayBufferConfig | None = None):
        super().__init__(config)
        self._entries: dict[str, list[_Entry]] = {}
        self._seq = itertools.count()
        self.discarded_expired = 0  # groups dropped because they expired and were not retryable

    # ------------------------------------------------------------------------------- policy
    def _order_key(self, e: _Entry) -> tuple:
        return (e.seq,)

    # ---------------------------------------------------------------------------- lifecycle
    def _apply_staleness(self, group: Group, consumer_step: int, rule: StalenessRule) -> bool:
        """Refresh staleness and expiry of ``group`` in place; return False if it must be discarded."""
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
            expired = rule.stale_threshold is not None and s.staleness >= rule.stale_threshold
            if not expired and rule.token_stale_threshold is not None:
                keep = token_keep_mask(s, consumer_step, rule.token_stale_threshold)
                expired = not any(keep)
            if expired:
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

    def put(self, group: Group, *, consumer_step: int | None = None, rule: StalenessRule | None = None) -> Status | None:
        """Store a group; return its stored status, or None if it expired and was discarded."""
        if not group.samples:
            return None
        if consumer_step is not None and rule is not None:
            if not self._apply_staleness(group, consumer_step, rule):
                self.discarded_expired += 1
                return None
        entry = _Entry(group, next(self._seq))
        self._entries.setdefault(group.task_name, []).append(entry)
        return entry.status

    def refresh(self, consumer_step: int, rules: dict[str, StalenessRule]) -> dict[str, int]:
        """Re-apply the staleness lifecycle to stored groups; return expired groups per task."""
        expired: dict[str, int] = {}
        for task, entries in self._entries.items():
            rule = rules.get(task)
            if rule is None:
                continue
            kept = []
            for e in entries:
                before = e.status
                ok = self._apply_staleness(e.group, consumer_step, rule)
                e.status, e.staleness = e.group.status, e.group.staleness
                if not ok:
                    self.discarded_expired += 1
                    expired[task] = expired.get(task, 0) + 1
                    continue
                if e.status == Status.EXPIRED and before != Status.EXPIRED:
                    expired[task] = expired.get(task, 0) + 1
                kept.append(e)
            entries[:] = kept
        return expired

    # ------------------------------------------------------------------------------- access
    def count(self, task: str | None = None, status: Status | None = None) -> int:
        tasks = [task] if task is not None else list(self._entries)
        return sum(1 for t in tasks for e in self._entries.get(t, []) if status is None or e.status == status)

    def is_ready(self, sizes: dict[str, int]) -> bool:
        return all(self.count(t, Status.COMPLETED) >= n for t, n in sizes.items() if n > 0)

    def _pop(self, task: str, status: Status, n: int, key) -> list[Group]:
        entries = self._entries.get(task, [])
        chosen = sorted((e for e in entries if e.status == status), key=key)[: max(n, 0)]
        ids = {id(e) for e in chosen}
        entries[:] = [e for e in entries if id(e) not in ids]
        return [e.group for e in chosen]

    def take(self, task: str, n: int) -> list[Group]:
        """Pop up to ``n`` COMPLETED groups of ``task`` in policy order."""
        return self._pop(task, Status.COMPLETED, n, self._order_key)

    def take_batch(self, sizes: dict[str, int], *, consumer_step: int | None = None,
                   rules: dict[str, StalenessRule] | None = None) -> dict[str, list[Group]]:
        """Pop up to ``sizes[task]`` COMPLETED groups per task (``n <= 0`` -> ``[]``).

        With ``consumer_step`` and ``rules`` the staleness lifecycle is applied first, so every
        returned group is within its task's bound at that step whatever was refreshed before.
        """
        if consumer_step is not None and rules is not None:
            self.refresh(consumer_step, {t: r for t, r in rules.items() if sizes.get(t, 0) > 0})
        return {t: self.take(t, n) if n > 0 else [] for t, n in sizes.items()}

    def pop_for_rollout(self, task: str, statuses: Iterable[Status]) -> Group | None:
        """The oldest group with the first status (in order) that has one: re-rolls and continuations."""
        for st in statuses:
            got = self._pop(task, st, 1, lambda e: (e.seq,))
            if got:
                return got[0]
        return None

    def groups(self, task: str | None = None, status: Status | None = None) -> list[Group]:
        """Stored groups (not removed), in insertion order: for inspection and metrics."""
        tasks = [task] if task is not None else list(self._entries)
        entries = [e for t in tasks for e in self._entries.get(t, []) if status is None or e.status == status]
        return [e.group for e in sorted(entries, key=lambda e: e.seq)]

    def __len__(self) -> int:
        return self.count()

    # ---------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "policy": self.name,
            "discarded_expired": self.discarded_expired,
            "entries": [
                {"task": t, "seq": e.seq, "group": e.group.to_dict()}
                for t, entries in self._entries.items() for e in entries
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.count():
            raise RuntimeError("Cannot resume into a non-empty replay buffer")
        if state.get("policy") != self.name:
            raise RuntimeError(f"Replay policy mismatch: expected {self.name!r}, got {state.get('policy')!r}")
        self.discarded_expired = state.get("discarded_expired", 0)
        max_seq = -1
        for item in state["entries"]:
            entry = _Entry(Group.from_dict(item["group"]), item["seq"])
            self._entries.setdefault(item["task"], []).append(entry)
            max_seq = max(max_seq, item["seq"])
        self._seq = itertools.count(max_seq + 1)


class AsyncReplayBuffer(ReplayBuffer):
    """Staleness-first replay buffer (XTuner's AsyncReplayBuffer): oldest data is trained first."""

    name: ClassVar[str] = "async"

    def _order_key(self, e: _Entry) -> tuple:
        return (-e.staleness, e.seq)


@hookimpl
def register_replay_buffers():
    return [ReplayBuffer, AsyncReplayBuffer]
