"""The values inside a judger's reward: numpy scalars become Python values, so that an async run's
checkpoint (which holds judged samples) saves; any other non-plain value and a non-bool
``exclude_from_loss`` fail the sample, naming the key."""

from __future__ import annotations

import logging
import asyncio
from collections import OrderedDict

import numpy as np
import pytest

from rlcli.judgers.base import Judger
from rlcli.judging import JudgePool, normalize_reward
from rlcli.produce.replay_buffer import AsyncReplayBuffer
from rlcli.train.checkpoint_files import load_pt, save_pt
from rlcli.types import EXCLUDE_FROM_LOSS, Group, Sample, Status

_PLAIN = (dict, list, tuple, str, int, float, bool, type(None))


class NumpyJudger(Judger):
    """Returns the reward its response names (module level: picklable, for the process executor)."""

    name = "numpy_values"

    def judge(self, response, label, sample):
        if response == "numpy":
            return {"score": np.float32(0.5), "acc": np.float64(1.0), "n": np.int64(3), "ok": np.bool_(True),
                    "parts": [np.float16(0.25), {"k": np.int32(2)}], "pair": (np.uint8(1), "x"),
                    EXCLUDE_FROM_LOSS: np.bool_(False)}
        if response == "scalar":
            return np.float64(0.75)
        if response == "set":
            return {"score": 1.0, "tags": {1, 2}}
        if response == "nested":
            return {"score": 1.0, "details": {"steps": [1, b"raw"]}}
        if response == "object":
            return {"score": 1.0, "config": NumpyJudger.Config()}
        if response == "array":
            return {"score": 1.0, "probs": np.array([0.1, 0.9])}
        if response == "exclude_str":
            return {"score": 1.0, EXCLUDE_FROM_LOSS: "false"}
        raise AssertionError(response)


def mk(response: str, uid: int = 0) -> Sample:
    return Sample(uid=uid, group_id=0, task_name="t", prompt_ids=[1, 2], response=response, label="x",
                  status=Status.COMPLETED)


def judged(executor: str, *responses: str) -> tuple[list[Sample], dict]:
    pool = JudgePool(NumpyJudger(), executor=executor, workers=1, timeout_s=30)
    try:
        samples = [mk(r, i) for i, r in enumerate(responses)]
        asyncio.run(pool.judge_group(samples))
        return samples, pool.pop_stats()
    finally:
        pool.close()


def assert_plain(value, where="reward"):
    assert type(value) in _PLAIN, f"{where} is a {type(value).__name__}"
    if isinstance(value, dict):
        for k, v in value.items():
            assert_plain(k, f"a key of {where}")
            assert_plain(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            assert_plain(v, f"{where}[{i}]")


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
def test_numpy_values_are_scored_as_python_values_and_checkpoint(executor, tmp_path):
    (s, scalar), stats = judged(executor, "numpy", "scalar")
    assert s.status == Status.COMPLETED and s.error is None and stats["judger/errors"] == 0
    assert s.reward == {"score": 0.5, "acc": 1.0, "n": 3, "ok": True, "parts": [0.25, {"k": 2}], "pair": (1, "x"),
                        EXCLUDE_FROM_LOSS: False}
    assert_plain(s.reward)
    assert type(s.reward["score"]) is float and not s.excluded_from_loss
    assert scalar.reward == {"score": 0.75} and type(scalar.reward["score"]) is float
    # what an async run checkpoints: the replay buffer's judged groups, saved as extra_state.pt
    buffer = AsyncReplayBuffer()
    buffer.put(Group(0, "t", [s, scalar]))
    save_pt(tmp_path / "extra_state.pt", {"replay_buffer": buffer.state_dict()})
    restored = AsyncReplayBuffer()
    restored.load_state_dict(load_pt(tmp_path / "extra_state.pt")["replay_buffer"])
    assert [x.reward for x in restored.groups()[0].samples] == [s.reward, scalar.reward]


@pytest.mark.parametrize("executor", ["inline", "thread"])
def test_a_non_plain_value_fails_the_sample_naming_its_key(executor):
    samples, stats = judged(executor, "set", "nested", "object", "array", "numpy")
    expected = ["'tags' is of type set", "'details'['steps'][1] is of type bytes",
                "'config' is of type rlcli.judgers.base.JudgerConfig", "'probs' is of type numpy.ndarray"]
    for s, words in zip(samples, expected):
        assert s.status == Status.FAILED and s.reward is None, s.reward
        assert words in s.error and "plain data" in s.error, s.error
    assert samples[-1].status == Status.COMPLETED  # the pool keeps scoring the others
    assert stats["judger/calls"] == 5 and stats["judger/errors"] == 4


def test_normalize_reward_converts_numpy_and_keeps_everything_else():
    assert normalize_reward({"score": np.float32(1.0)}) == ({"score": 1.0}, None)
    assert normalize_reward(np.bool_(True)) == ({"score": 1.0}, None)
    reward, reason = normalize_reward({"acc": np.float64(1.0), "score": 1, "pred": None, 7: "x"})
    assert reason is None and list(reward) == ["acc", "score", "pred", 7]  # key order kept
    assert type(reward["acc"]) is float and type(reward["score"]) is float
    reward, _ = normalize_reward(OrderedDict(score=1.0, nested=OrderedDict(a=[1])))
    assert type(reward) is dict and type(reward["nested"]) is dict
    for bad, words in [({"score": 1.0, (1, 2): 0}, "a key is (1, 2), of type tuple"),
                       ({"score": 1.0, "d": {frozenset(): 0}}, "'d' has a key frozenset() of type frozenset"),
                       ({"score": 1.0, "when": np.datetime64("2024-01-01")}, "'when' is of type datetime.date"),
                       ({"score": 10 ** 400}, "too large for a float")]:
        reward, reason = normalize_reward(bad)
        assert reward is None and words in reason, reason
    loop: list = []
    loop.append(loop)
    assert "nested too deeply" in normalize_reward({"score": 1.0, "loop": loop})[1]


@pytest.mark.parametrize("value", ["false", "yes", 1, 0, None, [True]])
def test_exclude_from_loss_must_be_a_bool(value):
    reward, reason = normalize_reward({"score": 1.0, EXCLUDE_FROM_LOSS: value})
    assert reward is None and f"'{EXCLUDE_FROM_LOSS}' = {value!r}" in reason and "must be a bool" in reason
    s = mk("x")
    s.reward = {"score": 1.0, EXCLUDE_FROM_LOSS: value}  # e.g. restored from an older checkpoint
    assert s.excluded_from_loss is False


def test_only_a_true_exclude_from_loss_excludes():
    for value, excluded in [(True, True), (False, False), (np.bool_(True), True)]:
        reward, reason = normalize_reward({"score": 1.0, EXCLUDE_FROM_LOSS: value})
        assert reason is None and reward[EXCLUDE_FROM_LOSS] is excluded
        s = mk("x")
        s.reward = reward
        assert s.excluded_from_loss is excluded
    (s,), stats = judged("inline", "exclude_str")
    assert s.status == Status.FAILED and "'exclude_from_loss' = 'false' (str)" in s.error
    assert stats["judger/errors"] == 1


def test_a_reward_too_large_to_keep_is_cut_with_a_warning(caplog):
    """A reward travels with its sample into rollout dumps, the replay buffer and checkpoints: one of
    megabytes has its large values replaced by a note of their size; the score and the rest stay."""
    from rlcli.judgers import calls

    calls._warned.discard("<cut>")
    big = {"score": 0.5, "transcript": "x" * 3_000_000, "acc": 1.0, EXCLUDE_FROM_LOSS: False, "digits": 10 ** 5000}
    with caplog.at_level(logging.WARNING, logger="rlcli.judgers.calls"):
        reward, reason = normalize_reward(big)
    assert reason is None and reward["score"] == 0.5 and reward["acc"] == 1.0 and reward[EXCLUDE_FROM_LOSS] is False
    assert reward["transcript"] == "<cut by rlcli: 3000002 characters>" and reward["digits"].startswith("<cut by rlcli")
    assert "a reward of" in caplog.text and "more than 65536" in caplog.text
    many = {"score": 1.0, **{f"k{i}": "y" * 900 for i in range(200)}}  # no one value is large; together they are
    reward, _ = normalize_reward(many)
    assert set(reward) == {"score", "cut"} and "every other key" in reward["cut"]
    small = {"score": 1.0, "why": "z" * 60_000}  # within the cap: kept whole
    assert normalize_reward(small) == (small, None)
