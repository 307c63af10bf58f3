"""Advantage estimators against hand-written reference formulas (XTuner acceptance 43, 44)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from pydantic import ValidationError

from rlcli.algo.advantage import (
    DrGRPOAdvantage,
    GRPOAdvantage,
    PassAtKAdvantage,
    RLOOAdvantage,
    XTunerDrGRPOAdvantage,
)
from rlcli.plugins import get_registry


def _grpo_ref(r: list[float], eps: float, unbiased: bool) -> list[float]:
    n = len(r)
    mean = sum(r) / n
    var = sum((x - mean) ** 2 for x in r) / ((n - 1) if unbiased else n)
    return [(x - mean) / (math.sqrt(var) + eps) for x in r]


def _approx(t: torch.Tensor, ref: list[float], tol: float = 1e-5) -> None:
    assert t.dtype == torch.float32
    assert t.tolist() == pytest.approx(ref, abs=tol)


def test_registered_with_configs():
    reg = get_registry()
    for name, cls in [("grpo", GRPOAdvantage), ("dr_grpo", DrGRPOAdvantage), ("rloo", RLOOAdvantage),
                      ("pass_at_k", PassAtKAdvantage), ("xtuner_dr_grpo", XTunerDrGRPOAdvantage)]:
        assert reg.get("advantage_estimator", name) is cls
        assert cls.__doc__.strip() and "\n" not in cls.__doc__.strip()
        for field in cls.Config.model_fields.values():
            assert field.description


def test_grpo_acceptance_43():
    adv = GRPOAdvantage().compute(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    _approx(adv, [0.866025, -0.866025, -0.866025, 0.866025], 1e-5)
    assert GRPOAdvantage().compute(torch.tensor([0.7, 0.7, 0.7])).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("std", ["unbiased", "biased"])
def test_grpo_matches_reference(std):
    rng = random.Random(3)
    est = GRPOAdvantage(GRPOAdvantage.Config(eps=1e-3, std=std))
    for _ in range(20):
        r = [rng.uniform(-2, 3) for _ in range(rng.randint(2, 9))]
        _approx(est.compute(torch.tensor(r)), _grpo_ref(r, 1e-3, std == "unbiased"))


def test_grpo_degenerate_groups_are_zero_not_nan():
    est = GRPOAdvantage()
    assert est.compute(torch.tensor([5.0])).tolist() == [0.0]
    # float rounding must not leak a tiny non-zero value through 0/eps
    assert est.compute(torch.tensor([0.1, 0.1, 0.1])).tolist() == [0.0, 0.0, 0.0]
    assert est.compute([1.0, 1.0]).tolist() == [0.0, 0.0]


def test_dr_grpo_is_centered_only():
    est = DrGRPOAdvantage()
    _approx(est.compute(torch.tensor([1.0, 0.0, 0.0, 1.0])), [0.5, -0.5, -0.5, 0.5])
    _approx(est.compute(torch.tensor([3.0, -1.0, 1.0]), torch.tensor([5, 9, 2])), [2.0, -2.0, 0.0])
    assert est.compute(torch.tensor([2.0])).tolist() == [0.0]


def test_xtuner_dr_grpo_keeps_the_std_and_scales_by_length():
    """XTuner's DrGRPOEstimator: z-score (n-1 std, eps 1e-8) times length / 32768. The issue's figure:
    rewards [1, 0], lengths [100, 100] give ±0.00216 here and ±0.5 with the paper's dr_grpo."""
    est = XTunerDrGRPOAdvantage()
    z = 0.5 / (math.sqrt(0.5) + 1e-8)  # mean 0.5, unbiased std sqrt(0.5)
    adv = est.compute(torch.tensor([1.0, 0.0]), torch.tensor([100.0, 100.0]))
    _approx(adv, [z * 100 / 32768, -z * 100 / 32768], 1e-9)
    assert adv.tolist() == pytest.approx([0.00216, -0.00216], abs=5e-6)
    _approx(DrGRPOAdvantage().compute(torch.tensor([1.0, 0.0]), torch.tensor([100.0, 100.0])), [0.5, -0.5])
    # each sample by its own length; options; degenerate groups are 0 (XTuner: NaN for one sample)
    rng = random.Random(7)
    for _ in range(10):
        r = [rng.uniform(-1, 2) for _ in range(rng.randint(2, 8))]
        n = [rng.randint(1, 4000) for _ in r]
        ref = [a * m / 1000.0 for a, m in zip(_grpo_ref(r, 1e-3, True), n)]
        _approx(XTunerDrGRPOAdvantage(XTunerDrGRPOAdvantage.Config(max_length=1000, eps=1e-3)).compute(
            torch.tensor(r), torch.tensor(n)), ref)
    assert est.compute(torch.tensor([1.0]), torch.tensor([5.0])).tolist() == [0.0]
    assert est.compute(torch.tensor([0.3, 0.3]), torch.tensor([5.0, 9.0])).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="length"):
        est.compute(torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="length"):
        est.compute(torch.tensor([1.0, 0.0]), torch.tensor([3.0]))
    with pytest.raises(ValidationError):
        XTunerDrGRPOAdvantage.Config(max_length=0)


def test_rloo_acceptance_44_and_reference():
    est = RLOOAdvantage()
    _approx(est.compute(torch.tensor([1.0, 0.0])), [1.0, -1.0])
    _approx(est.compute(torch.tensor([0.25])), [0.25])
    rng = random.Random(5)
    for _ in range(10):
        r = [rng.uniform(-1, 1) for _ in range(rng.randint(2, 8))]
        k = len(r)
        _approx(est.compute(torch.tensor(r)), [x - (sum(r) - x) / (k - 1) for x in r])


def _pass_at_k_ref(r: list[float], k: int, eps: float) -> list[float]:
    """XTuner §8.2, written out independently."""
    n = len(r)
    c = sum(1 for x in r if x > 0)
    rho = c / n if n < k else 1 - math.comb(n - c, k) / math.comb(n, k)
    sigma = math.sqrt(rho * (1 - rho)) + eps
    out = []
    for x in r:
        if x > 0:
            out.append((1 - rho) / sigma)
        else:
            out.append((1 - rho - math.comb(n - c - 1, k - 1) / math.comb(n - 1, k - 1)) / sigma)
    return out


def test_pass_at_k_acceptance_44():
    adv = PassAtKAdvantage(PassAtKAdvantage.Config(k=2)).compute(torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert adv[0].item() == pytest.approx(1.0, abs=1e-4)
    assert adv[1:].tolist() == pytest.approx([-1 / 3] * 3, abs=1e-4)


def test_pass_at_k_matches_reference_formula():
    rng = random.Random(11)
    for _ in range(30):
        k = rng.randint(1, 4)
        n = rng.randint(max(k, 2), 9)
        r = [float(rng.random() < 0.4) for _ in range(n)]
        if 0 < sum(r) < n:
            est = PassAtKAdvantage(PassAtKAdvantage.Config(k=k, eps=1e-6))
            _approx(est.compute(torch.tensor(r)), _pass_at_k_ref(r, k, 1e-6), 1e-4)


def test_pass_at_k_edge_cases_never_explode():
    est = PassAtKAdvantage(PassAtKAdvantage.Config(k=4))
    assert est.compute(torch.tensor([0.0, 0.0, 0.0, 0.0])).tolist() == [0.0] * 4  # XTuner: -1/eps
    assert est.compute(torch.tensor([1.0, 1.0, 1.0, 1.0])).tolist() == [0.0] * 4
    assert est.compute(torch.tensor([1.0])).tolist() == [0.0]
    # n < k: pass@1, which equals biased-std GRPO on the binarised rewards
    r = [1.0, 0.0, 0.0]
    _approx(est.compute(torch.tensor(r)), _grpo_ref(r, 1e-6, unbiased=False), 1e-4)
    # rewards > 0 count as correct, whatever their size
    _approx(est.compute(torch.tensor([0.3, -1.0, 0.0, 2.0])),
            PassAtKAdvantage(PassAtKAdvantage.Config(k=4)).compute(torch.tensor([1.0, 0.0, 0.0, 1.0])).tolist())


def test_bad_inputs_and_configs():
    with pytest.raises(ValueError, match="empty"):
        GRPOAdvantage().compute(torch.tensor([]))
    with pytest.raises(ValueError, match="finite"):
        GRPOAdvantage().compute(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValidationError):
        GRPOAdvantage.Config(std="population")
    with pytest.raises(ValidationError):
        PassAtKAdvantage.Config(k=0)
    with pytest.raises(ValidationError):
        GRPOAdvantage.Config(epsilon=1.0)


@pytest.mark.parametrize("name,options", [("grpo", {}), ("grpo", {"std": "biased", "eps": 0.0}), ("dr_grpo", {}),
                                          ("xtuner_dr_grpo", {"max_length": 64}), ("rloo", {}),
                                          ("pass_at_k", {"k": 2})])
def test_compute_groups_equals_compute_per_group(name, options):
    """Many groups at once (the batched pass of the built-ins, the per-group loop otherwise) give
    exactly the advantages ``compute`` gives each group, degenerate groups included."""
    cls = get_registry().get("advantage_estimator", name)
    est = cls(cls.Config(**options))
    rng = random.Random(0)
    for k in (2, 3, 8, 16):
        groups = [[rng.choice([0.0, 1.0, rng.random(), rng.gauss(0, 3), float(rng.randint(0, 6))]) for _ in range(k)]
                  for _ in range(40)]
        groups += [[1.0] * k, [0.0] * k, [2.5] * (k - 1) + [0.5]]  # all equal (no signal), one different
        lengths = [[rng.randint(1, 50) for _ in range(k)] for _ in groups]
        want = [est.compute(torch.tensor(r, dtype=torch.float32), torch.tensor(n, dtype=torch.float32)).tolist()
                for r, n in zip(groups, lengths)]
        assert est.compute_groups(groups, lengths) == want
    # unequal sizes, a group of one, and a non-finite reward take the per-group path (which raises)
    mixed = [[1.0, 0.0, 1.0], [0.5], [3.0, 1.0]]
    assert est.compute_groups(mixed, [[3] * len(r) for r in mixed]) == [
        est.compute(torch.tensor(r, dtype=torch.float32), torch.full((len(r),), 3.0)).tolist() for r in mixed]
    with pytest.raises(ValueError, match="finite"):
        est.compute_groups([[1.0, 0.0], [float("nan"), 1.0]], [[1, 1], [1, 1]])


def test_sequences_from_groups_uses_an_estimator_without_compute_groups():
    """A duck-typed estimator with only ``compute`` (not derived from the base class) still works."""
    from rlcli.runner.sequences import sequences_from_groups
    from rlcli.types import Group, Sample, Status

    class Centered:
        def compute(self, rewards, lengths=None):
            return rewards - rewards.mean()

    def sample(uid, score):
        return Sample(uid=uid, group_id=0, task_name="t", prompt_ids=[1, 2], response_ids=[3, 4], logprobs=[-1.0, -1.0],
                      response_mask=[1, 1], token_versions=[0, 0], status=Status.COMPLETED, reward={"score": score})

    group = Group(group_id=0, task_name="t", samples=[sample(0, 1.0), sample(1, 0.0), sample(2, 0.5)])
    seqs, adv = sequences_from_groups([group], Centered())
    assert adv == [0.5, -0.5, 0.0] and [s.advantage for s in seqs] == adv
