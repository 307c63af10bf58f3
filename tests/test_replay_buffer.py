"""Replay buffers and the staleness lifecycle (XTuner behaviours 7-19, in policy versions)."""

import pytest

from rlcli.replay_buffer import AsyncReplayBuffer, ReplayBuffer, StalenessRule, token_keep_mask
from rlcli.types import Group, Sample, Status, group_status, seq_staleness, status_from_finish_reason


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


def test_seq_staleness_and_thresholds():
    assert seq_staleness(3, 5) == 1
    assert seq_staleness(None, 5) == 0
    # (max_staleness + 1) * interval: behaviour 7 with interval 4
    assert (0 + 1) * 4 == 4 and (1 + 1) * 4 == 8


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
