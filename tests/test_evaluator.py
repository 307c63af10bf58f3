"""Evaluator metrics: accuracy, pass@k (unbiased and XTuner's first-k), reward stats, per-source keys."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from pydantic import ValidationError

from rlcli.evaluator_metrics import (
    AccuracyMetric,
    PassAtKMetric,
    RewardStatsMetric,
    eval_batch_size,
    evaluate,
    pass_at_k,
)
from rlcli.plugins import get_registry
from rlcli.types import Sample, Status

_uid = itertools.count()


def judged(score: float | None, group_id: int = 0, source: str = "src", status: Status = Status.COMPLETED,
           task: str = "eval") -> Sample:
    s = Sample(uid=next(_uid), group_id=group_id, task_name=task, prompt_ids=[1], data_source=source, status=status)
    s.reward = None if score is None else {"score": float(score)}
    return s


def groups(*successes: list[int], source: str = "src") -> list[Sample]:
    return [judged(x, gid, source) for gid, row in enumerate(successes) for x in row]


# ------------------------------------------------------------------------------ accuracy
def test_accuracy_xtuner_behaviour_59():
    samples = [judged(x) for x in (1, 0, 0.5, -1)]
    xtuner = AccuracyMetric(AccuracyMetric.Config(correct_at="positive"))
    assert xtuner.compute(samples) == {"accuracy": 0.5, "failed": 0.0}


def test_accuracy_counts_full_score_by_default_and_correct_at_sets_it():
    """Issue 29: partial credit (0.5) is not correct unless the recipe says so."""
    samples = [judged(x) for x in (1, 0, 0.5, 0.99, 2.0, -1)]
    assert AccuracyMetric().compute(samples)["accuracy"] == pytest.approx(2 / 6)
    assert AccuracyMetric(AccuracyMetric.Config(correct_at=0.5)).compute(samples)["accuracy"] == pytest.approx(4 / 6)
    partial = groups([0.5, 0.5], [1, 0])
    assert PassAtKMetric(PassAtKMetric.Config(k=[2])).compute(partial)["pass@2"] == 0.5
    assert PassAtKMetric(PassAtKMetric.Config(k=[2], correct_at="positive")).compute(partial)["pass@2"] == 1.0
    for bad in ("full", None):
        with pytest.raises(ValidationError):
            AccuracyMetric.Config(correct_at=bad)


def test_accuracy_empty_and_failed():
    assert AccuracyMetric().compute([]) == {"accuracy": 0.0, "failed": 0.0}
    failed = judged(None, status=Status.FAILED)
    failed_with_stale_reward = judged(1.0, status=Status.FAILED)  # a FAILED sample never counts as solved
    out = AccuracyMetric().compute([judged(1), failed, failed_with_stale_reward, judged(0)])
    assert out == {"accuracy": 0.25, "failed": 2.0}


# -------------------------------------------------------------------------------- pass@k
def test_pass_at_k_estimator_values():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(5, 5, 3) == 1.0
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - math.comb(7, 2) / math.comb(10, 2))
    for bad in [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_pass_at_k_unbiased_matches_brute_force():
    rng = random.Random(0)
    for _ in range(30):
        n = rng.randint(1, 8)
        wins = [rng.random() < 0.4 for _ in range(n)]
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(wins, k))
            assert pass_at_k(n, sum(wins), k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_pass_at_k_xtuner_behaviour_59_first_k():
    """2 prompts x 4 attempts, successes [1,0,0,0] and [0,0,0,0]: XTuner's first-k definition."""
    samples = groups([1, 0, 0, 0], [0, 0, 0, 0])
    out = PassAtKMetric(PassAtKMetric.Config(estimator="first_k")).compute(samples)
    assert out["pass@1"] == out["pass@2"] == out["pass@4"] == 0.5
    assert out["avg_pass@4"] == 0.125
    assert out["groups"] == 2 and out["attempts"] == 8
    assert "pass@8" not in out and "pass@16" not in out  # k larger than the group size is skipped


def test_pass_at_k_unbiased_default_differs_from_first_k():
    samples = groups([1, 0, 0, 0], [0, 0, 0, 0])
    out = PassAtKMetric().compute(samples)
    assert out["pass@1"] == pytest.approx(0.125)  # = avg success rate, independent of attempt order
    assert out["pass@2"] == pytest.approx(0.25)
    assert out["pass@4"] == pytest.approx(0.5)
    assert out["avg_pass@4"] == pytest.approx(0.125)
    assert out["mean_score"] == pytest.approx(0.125)
    # moving the success to the last attempt changes first-k pass@1, not the unbiased value
    late = groups([0, 0, 0, 1], [0, 0, 0, 0])
    assert PassAtKMetric().compute(late)["pass@1"] == pytest.approx(0.125)
    assert PassAtKMetric(PassAtKMetric.Config(estimator="first_k")).compute(late)["pass@1"] == 0.0


def test_pass_at_k_groups_by_task_and_group_id_and_orders_by_uid():
    a = [judged(0, 0, task="a"), judged(1, 0, task="a")]
    b = [judged(1, 0, task="b"), judged(0, 0, task="b")]  # same group_id, other task: another prompt
    mixed = [b[1], a[1], b[0], a[0]]
    out = PassAtKMetric(PassAtKMetric.Config(k=[1, 2], estimator="first_k")).compute(mixed)
    assert out["groups"] == 2
    assert out["pass@1"] == 0.5  # a's first attempt (lowest uid) fails, b's succeeds
    assert out["pass@2"] == 1.0


def test_pass_at_k_uneven_groups_and_failed_attempts():
    samples = groups([1, 0, 0, 0], [0, 1]) + [judged(None, 9, status=Status.FAILED), judged(1, 9)]
    out = PassAtKMetric().compute(samples)
    assert set(k for k in out if k.startswith("pass@")) == {"pass@1", "pass@2"}  # smallest group has 2
    assert out["pass@1"] == pytest.approx((0.25 + 0.5 + 0.5) / 3)
    assert out["avg_pass@2"] == pytest.approx((0.25 + 0.5 + 0.5) / 3)


def test_pass_at_k_empty_and_config():
    assert PassAtKMetric().compute([]) == {"groups": 0.0, "attempts": 0.0}
    assert PassAtKMetric().config.k == [1, 2, 4, 8, 16]
    assert PassAtKMetric.Config(k=[4, 1, 4]).k == [1, 4]
    for bad in ({"k": []}, {"k": [0]}, {"estimator": "biased"}, {"kk": [1]}):
        with pytest.raises(ValidationError):
            PassAtKMetric.Config(**bad)


# ------------------------------------------------------------------------- reward stats
def test_reward_stats():
    samples = [judged(1), judged(0), judged(0.5), judged(-1), judged(None, status=Status.FAILED)]
    out = RewardStatsMetric().compute(samples)
    assert out["reward/count"] == 4
    assert out["reward/mean"] == pytest.approx(0.125)
    assert out["reward/min"] == -1 and out["reward/max"] == 1
    assert out["reward/std"] == pytest.approx(math.sqrt(sum((x - 0.125) ** 2 for x in (1, 0, 0.5, -1)) / 4))
    assert RewardStatsMetric().compute([]) == {"reward/count": 0.0}


# ------------------------------------------------------------------------------ evaluate
def test_evaluate_merges_metrics_single_source():
    samples = groups([1, 0], [0, 0])
    out = evaluate(samples, [AccuracyMetric(), PassAtKMetric(), RewardStatsMetric()])
    assert out["accuracy"] == 0.25 and out["pass@2"] == 0.5 and out["reward/max"] == 1.0
    assert not any(k.startswith("src/") for k in out)  # one data source: no per-source keys
    assert all(isinstance(v, float) for v in out.values())


def test_evaluate_reports_per_source_metrics():
    samples = groups([1, 1], source="openai/gsm8k") + [judged(0, 7, "toy"), judged(0, 7, "toy")]
    out = evaluate(samples, [AccuracyMetric(), PassAtKMetric(PassAtKMetric.Config(k=[1]))])
    assert out["accuracy"] == 0.5
    assert out["openai/gsm8k/accuracy"] == 1.0
    assert out["toy/accuracy"] == 0.0
    assert out["toy/pass@1"] == 0.0 and out["openai/gsm8k/pass@1"] == 1.0
    assert out["toy/failed"] == 0.0


def test_evaluate_rejects_duplicate_keys():
    with pytest.raises(ValueError, match="'accuracy'"):
        evaluate([judged(1)], [AccuracyMetric(), AccuracyMetric()])


def test_evaluate_accepts_any_object_with_compute():
    class Count:
        name = "count"

        def compute(self, samples):
            return {"count": len(samples)}

    assert evaluate([judged(1), judged(0)], [Count()]) == {"count": 2.0}


# ----------------------------------------------------------------------- eval batch size
def test_eval_batch_size_xtuner_behaviour_60():
    assert eval_batch_size(1000, sample_num=128, sample_ratio=0.5) == 128
    assert eval_batch_size(1000, sample_ratio=0.5) == 500
    assert eval_batch_size(1000) == 1000
    assert eval_batch_size(0, sample_num=4) == 4
    assert eval_batch_size(3, sample_ratio=0.1) == 1  # never zero prompts
    with pytest.raises(ValueError, match="empty"):
        eval_batch_size(0)
    with pytest.raises(ValueError):
        eval_batch_size(10, sample_ratio=1.5)


# -------------------------------------------------------------------------- registration
def test_metrics_are_registered():
    reg = get_registry()
    for name, cls in (("accuracy", AccuracyMetric), ("pass_at_k", PassAtKMetric), ("reward_stats", RewardStatsMetric)):
        entry = reg.entry("evaluator_metric", name)
        assert entry.cls is cls and entry.dist == "rlcli" and entry.description
        for field_name, field in cls.Config.model_fields.items():
            assert field.description, f"{name}.{field_name}"
        with pytest.raises(ValidationError):
            cls.Config(bogus=1)
