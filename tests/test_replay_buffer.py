"""Replay buffers and the staleness lifecycle (XTuner behaviours 7-19, in policy versions)."""

import pytest

from rlcli.produce.staleness import seq_staleness
from rlcli.replay_buffer import AsyncReplayBuffer, ReplayBuffer, StalenessRule, token_keep_mask
from rlcli.types import Group, Sample, Status, group_status, status_from_finish_reason


def sample(uid, versions, status=Status.COMPLETED, task="t", mask=None, reward=1.0):
    s = Sample(uid=uid, group_id=uid // 2, task_name=task, prompt_ids=[5, 6])
    s.response_ids = [10 + i for i in range(len(versions))]
    s.logprobs = [-0.5] * len(versions)
    s.token_versions = list(versions)
    s.response_mask = mask if mask is not None else [1] * len(versions)
    s.status = status
    s.reward = {"score": reward}
    s.response = "x"
    return s


def group(gid, *samples, task="t"):
    return Group(gid, task, list(samples))


def test_seq_staleness():
    assert seq_staleness(3, 5) == 1
    assert seq_staleness(None, 5) == 0


def test_expiry_boundary():
    # behaviour 8: threshold 4, model step 4 -> consumer 8 keeps, 9 expires
    for consumer, expired in ((8, False), (9, True)):
        buf = ReplayBuffer()
        st = buf.put(group(0, sample(0, [4, 4])), consumer_step=consumer, rule=StalenessRule(4, retryable=True))
        assert (st == Status.EXPIRED) is expired


def test_partial_continuation_uses_oldest_version():
    # behaviour 11: versions [1, 3, 3] at step 5 -> staleness 3
    s = sample(0, [1, 3, 3])
    buf = ReplayBuffer()
    buf.put(group(0, s), consumer_step=5, rule=StalenessRule(None))
    assert s.staleness == 3


def test_token_mask():
    # behaviour 12
    s = sample(0, [0, 4])
    assert token_keep_mask(s, 5, 4) == [0, 1]
    assert token_keep_mask(s, 5, 8) == [1, 1]
    s.response_mask = [1, 0]
    assert token_keep_mask(s, 5, 4) == [0, 0]
    assert s.response_mask == [1, 0]  # pure


def test_stale_group_not_retryable_is_dropped():
    # behaviour 14
    buf = ReplayBuffer()
    g = group(0, sample(0, [1, 1]), sample(1, [1, 1]))
    assert buf.put(g, consumer_step=5, rule=StalenessRule(3, retryable=False)) is None
    assert len(buf) == 0 and all(s.status == Status.EXPIRED for s in g.samples)
    assert buf.discarded_expired == 1


def test_stale_group_retryable_resets_only_expired_members():
    # behaviours 15 and 16
    buf = ReplayBuffer()
    stale, fresh = sample(0, [0]), sample(1, [4])
    g = group(0, stale, fresh)
    assert buf.put(g, consumer_step=5, rule=StalenessRule(8, token_stale_threshold=4, retryable=True)) == Status.EXPIRED
    assert stale.status == Status.EXPIRED and stale.response_ids == [] and stale.reward is None
    assert stale.prompt_ids == [5, 6]
    assert fresh.status == Status.COMPLETED and fresh.response_ids == [10] and fresh.reward == {"score": 1.0}
    assert buf.pop_for_rollout("t", [Status.EXPIRED]) is g


def test_policies_and_persistence():
    # behaviour 17: async -> higher staleness first, FIFO ties; sync -> FIFO; both survive save/resume
    for cls, expected in ((ReplayBuffer, [0, 1, 2]), (AsyncReplayBuffer, [1, 0, 2])):
        buf = cls()
        buf.put(group(0, sample(0, [4])), consumer_step=5, rule=StalenessRule(None))  # staleness 0
        buf.put(group(1, sample(2, [2])), consumer_step=5, rule=StalenessRule(None))  # staleness 2
        buf.put(group(2, sample(4, [4])), consumer_step=5, rule=StalenessRule(None))
        restored = cls()
        restored.load_state_dict(buf.state_dict())
        assert [g.group_id for g in restored.take("t", 3)] == expected
        assert [g.group_id for g in buf.take("t", 3)] == expected


def test_resume_errors():
    # behaviour 18
    buf = ReplayBuffer()
    buf.put(group(0, sample(0, [1])))
    with pytest.raises(RuntimeError, match="non-empty"):
        buf.load_state_dict(buf.state_dict())
    with pytest.raises(RuntimeError, match="Replay policy mismatch"):
        AsyncReplayBuffer().load_state_dict(buf.state_dict())


def test_take_batch():
    # behaviour 19
    buf = ReplayBuffer()
    buf.put(group(0, sample(0, [1]), task="a"), )
    buf.put(group(1, sample(2, [1]), task="b"))
    buf.put(group(2, sample(4, [1], status=Status.FAILED), task="b"))
    out = buf.take_batch({"a": 1, "b": 2, "c": 0})
    assert [g.group_id for g in out["a"]] == [0] and [g.group_id for g in out["b"]] == [1] and out["c"] == []
    assert buf.count("a") == 0 and buf.count("b", Status.FAILED) == 1


def test_status_mapping_and_group_priority():
    # behaviour 56 (adapted: a group with completed members and judger-FAILED members still trains)
    assert status_from_finish_reason("stop") == Status.COMPLETED
    assert status_from_finish_reason("length") == Status.COMPLETED
    assert status_from_finish_reason("tool_calls") == Status.COMPLETED
    assert status_from_finish_reason("abort") == Status.ABORTED
    for r in ("error", None, "weird"):
        assert status_from_finish_reason(r) == Status.FAILED
    mk = lambda *sts: [sample(i, [1], status=s) for i, s in enumerate(sts)]  # noqa: E731
    assert group_status(mk(Status.COMPLETED, Status.COMPLETED)) == Status.COMPLETED
    assert group_status(mk(Status.COMPLETED, Status.FAILED)) == Status.COMPLETED
    assert group_status(mk(Status.FAILED, Status.FAILED)) == Status.FAILED
    assert group_status(mk(Status.FAILED, Status.ABORTED, Status.EXPIRED)) == Status.ABORTED
    assert group_status(mk(Status.EXPIRED, Status.FILTERED)) == Status.EXPIRED
    assert group_status(mk(Status.COMPLETED, Status.FILTERED)) == Status.FILTERED


# =============================================================== property: no loss, no dupes
import pickle  # noqa: E402

from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402

TASKS = ("a", "b")


class BufferMachine(RuleBasedStateMachine):
    """Any sequence of put / take / refresh (expire) / re-roll / save+restore / step advance:
    every uid ever put is exactly once in the buffer, taken, or discarded (and counted), and
    every taken sample is within its task's staleness bound at the step it was taken."""

    @initialize(policy=st.sampled_from([ReplayBuffer, AsyncReplayBuffer]),
                thresholds=st.lists(st.integers(1, 6), min_size=2, max_size=2),
                token=st.lists(st.one_of(st.none(), st.integers(1, 4)), min_size=2, max_size=2),
                retryable=st.lists(st.booleans(), min_size=2, max_size=2))
    def setup(self, policy, thresholds, token, retryable):
        self.cls = policy
        self.buf = policy()
        self.rules = {t: StalenessRule(thresholds[i], token[i], retryable[i]) for i, t in enumerate(TASKS)}
        self.step = 1
        self.next_uid = 0
        self.next_gid = 0
        self.put_uids: set[int] = set()
        self.taken: set[int] = set()
        self.discarded: set[int] = set()
        self.discarded_groups = 0

    def _stored_uids(self) -> list[int]:
        return [s.uid for g in self.buf.groups() for s in g.samples]

    def _reconcile(self, before: set[int], groups_before: int) -> None:
        """Groups that left the buffer without being taken were discarded as expired and counted."""
        gone = before - set(self._stored_uids())
        self.discarded |= gone
        dropped_groups = groups_before - len(self.buf)
        assert self.buf.discarded_expired == self.discarded_groups + dropped_groups
        self.discarded_groups = self.buf.discarded_expired

    @rule(task=st.sampled_from(TASKS), data=st.data())
    def put(self, task, data):
        k = data.draw(st.integers(1, 3))
        statuses = data.draw(st.lists(st.sampled_from([Status.COMPLETED, Status.COMPLETED, Status.ABORTED,
                                                       Status.FAILED]), min_size=k, max_size=k))
        members = []
        for stt in statuses:
            n = data.draw(st.integers(0 if stt == Status.ABORTED else 1, 4))
            low = data.draw(st.integers(max(0, self.step - 8), self.step - 1)) if self.step > 1 else 0
            versions = sorted(data.draw(st.lists(st.integers(low, max(low, self.step - 1)), min_size=n, max_size=n)))
            s = sample(self.next_uid, versions, status=stt, task=task)
            s.group_id = self.next_gid
            self.next_uid += 1
            members.append(s)
        g = Group(self.next_gid, task, members)
        self.next_gid += 1
        self.put_uids |= {s.uid for s in members}
        before = self.buf.discarded_expired
        stored = self.buf.put(g, consumer_step=self.step, rule=self.rules[task])
        if stored is None:
            assert self.buf.discarded_expired == before + 1
            self.discarded |= {s.uid for s in members}
            self.discarded_groups += 1

    @rule(delta=st.integers(0, 3))
    def advance(self, delta):
        self.step += delta

    @rule()
    def refresh(self):
        before, n = set(self._stored_uids()), len(self.buf)
        self.buf.refresh(self.step, self.rules)
        self._reconcile(before, n)

    @rule(sizes=st.fixed_dictionaries({t: st.integers(0, 3) for t in TASKS}))
    def take(self, sizes):
        before, n = set(self._stored_uids()), len(self.buf)
        got = self.buf.take_batch(sizes, consumer_step=self.step, rules=self.rules)
        taken_now = {s.uid for gs in got.values() for g in gs for s in g.samples}
        for t, gs in got.items():
            assert len(gs) <= sizes[t]
            if self.cls is AsyncReplayBuffer and gs:  # the stalest first
                rest = [g.staleness for g in self.buf.groups(t, Status.COMPLETED)]
                assert min(g.staleness for g in gs) >= max(rest, default=-1)
            for g in gs:
                assert g.status == Status.COMPLETED and g.task_name == t
                r = self.rules[t]
                for s in g.samples:
                    if s.status != Status.COMPLETED:
                        continue
                    assert s.staleness == self.step - min(s.token_versions) - 1 < r.stale_threshold
                    assert any(token_keep_mask(s, self.step, r.token_stale_threshold))
        assert not taken_now & self.taken
        self.taken |= taken_now
        n_taken = sum(len(v) for v in got.values())
        gone = before - set(self._stored_uids()) - taken_now
        self.discarded |= gone
        assert self.buf.discarded_expired - self.discarded_groups == n - n_taken - len(self.buf)
        self.discarded_groups = self.buf.discarded_expired

    @precondition(lambda self: len(self.buf) > 0)
    @rule(task=st.sampled_from(TASKS))
    def reroll(self, task):
        """Pop a group for a retry, regenerate what is not COMPLETED with the newest policy, put it back."""
        g = self.buf.pop_for_rollout(task, [Status.EXPIRED, Status.ABORTED])
        if g is None:
            return
        for s in g.samples:
            if s.status != Status.COMPLETED:
                done = sample(s.uid, [self.step - 1] * 2, task=task)
                s.response_ids, s.token_versions, s.logprobs = done.response_ids, done.token_versions, done.logprobs
                s.response_mask, s.status, s.reward = done.response_mask, Status.COMPLETED, done.reward
        if self.buf.put(g, consumer_step=self.step, rule=self.rules[task]) is None:
            self.discarded |= {s.uid for s in g.samples}
            self.discarded_groups += 1

    @rule()
    def save_restore(self):
        state = pickle.loads(pickle.dumps(self.buf.state_dict()))
        fresh = self.cls()
        fresh.load_state_dict(state)
        assert fresh.state_dict() == self.buf.state_dict()
        self.buf = fresh

    @invariant()
    def nothing_lost_or_duplicated(self):
        stored = self._stored_uids()
        assert len(stored) == len(set(stored))
        parts = [set(stored), self.taken, self.discarded]
        assert sum(len(p) for p in parts) == len(set().union(*parts))
        assert set().union(*parts) == self.put_uids


TestBufferMachine = BufferMachine.TestCase
TestBufferMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
