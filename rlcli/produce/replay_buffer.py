"""Replay buffers: where rollout groups wait between production and training.

The buffer stores whole groups, partitioned by task, each with a status (COMPLETED, ABORTED,
EXPIRED, ...) and a staleness. ``take`` pops COMPLETED groups in the buffer's policy order:

* ``sync``  - FIFO (oldest first).
* ``async`` - highest staleness first, FIFO among equals (consume the data closest to expiry).

``put`` (with a consumer step and a rule) and ``refresh`` apply the staleness lifecycle of
:mod:`rlcli.produce.staleness`: expired groups are kept for a re-roll or discarded.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rlcli import hookimpl
from rlcli.component import Component, ComponentConfig
from rlcli.produce.staleness import StalenessRule, apply_staleness
from rlcli.types import Group, Status


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
    """Base of replay buffers: stores groups and hands them out first in, first out, unless a
    subclass orders them otherwise (``_order_key``). Registered as ``sync``: :class:`SyncReplayBuffer`."""

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
    def put(self, group: Group, *, consumer_step: int | None = None, rule: StalenessRule | None = None) -> Status | None:
        """Store a group; return its stored status, or None if it expired and was discarded."""
        if not group.samples:
            return None
        if consumer_step is not None and rule is not None:
            if not apply_staleness(group, consumer_step, rule):
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
                ok = apply_staleness(e.group, consumer_step, rule)
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


class SyncReplayBuffer(ReplayBuffer):
    """FIFO replay buffer (XTuner's SyncReplayBuffer)."""

    name: ClassVar[str] = "sync"


class AsyncReplayBuffer(ReplayBuffer):
    """Staleness-first replay buffer (XTuner's AsyncReplayBuffer): oldest data is trained first."""

    name: ClassVar[str] = "async"

    def _order_key(self, e: _Entry) -> tuple:
        return (-e.staleness, e.seq)


@hookimpl
def register_replay_buffers():
    return [SyncReplayBuffer, AsyncReplayBuffer]
