"""KL-to-reference estimators against hand-written formulas (XTuner acceptance 48) and their config.

End-to-end behaviour of the KL term inside ``TrainWorker.train_step`` is in test_train_worker.py.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from pydantic import ValidationError

from rlcli.algo.kl import KL_TYPES, kl_penalty
from rlcli.config import KLConfig, TrainWorkerConfig


def _ref_value(kind: str, lp: float, ref: float) -> float:
    if kind == "k1":
        return lp - ref
    if kind == "k2":
        return 0.5 * (lp - ref) ** 2
    if kind == "abs":
        return abs(lp - ref)
    d = min(max(ref - lp, -20.0), 20.0)
    return min(max(math.exp(d) - d - 1.0, -10.0), 10.0)


def _ref_grad(kind: str, lp: float, ref: float) -> float:
    """d estimate / d logp, zero where a clamp is active."""
    if kind == "k1":
        return 1.0
    if kind == "k2":
        return lp - ref
    if kind == "abs":
        return math.copysign(1.0, lp - ref) if lp != ref else 0.0
    d = ref - lp
    if abs(d) > 20.0 or math.exp(d) - d - 1.0 > 10.0:
        return 0.0
    return 1.0 - math.exp(d)  # d/dlogp [e^(ref-lp) - (ref-lp) - 1]


@pytest.mark.parametrize("kind,expected", [("k3", 0.3679), ("low_var_kl", 0.3679), ("k1", 1.0), ("k2", 0.5),
                                           ("abs", 1.0)])
def test_acceptance_48(kind, expected):
    out = kl_penalty(torch.tensor([-1.0]), torch.tensor([-2.0]), kind)
    assert out.item() == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("kind", KL_TYPES)
def test_estimators_match_reference_values_and_gradients(kind):
    rng = random.Random(7)
    lp = [rng.uniform(-6, 0) for _ in range(300)]
    ref = [x + rng.uniform(-4, 4) for x in lp]
    lp += [-1.0, -30.0, -0.5, -2.0]  # clamped difference (d = 29.5 > 20), large value (> 10), equal values
    ref += [-31.0, -0.5, -5.0, -2.0]
    logp = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    out = kl_penalty(logp, torch.tensor(ref, dtype=torch.float64), kind)
    assert out.tolist() == pytest.approx([_ref_value(kind, a, b) for a, b in zip(lp, ref)], abs=1e-10)
    out.sum().backward()
    assert logp.grad.tolist() == pytest.approx([_ref_grad(kind, a, b) for a, b in zip(lp, ref)], abs=1e-10)


def test_low_var_kl_clamps():
    # d = ref - logp = 30 is clamped to 20 before exp, and e^20 - 21 is clamped to 10
    assert kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "k3").item() == 10.0
    # d = -30 is clamped to -20: e^-20 + 20 - 1 = 19.000000002 is clamped to 10
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([-30.0]), "k3").item() == 10.0
    # non-negative and zero exactly when the policies agree
    x = torch.linspace(-5, 5, 101)
    assert (kl_penalty(x, torch.zeros_like(x), "k3") >= 0).all()
    assert kl_penalty(torch.tensor([-0.7]), torch.tensor([-0.7]), "k3").item() == 0.0


def test_k3_is_an_unbiased_kl_estimate():
    """Under samples of p, mean(k1) and mean(k3) both estimate KL(p || q); k3 has the lower variance."""
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64), 0)
    q = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64) * 0.5, 0)
    exact = float((p * (p.log() - q.log())).sum())
    x = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    k1 = kl_penalty(p.log()[x], q.log()[x], "k1")
    k3 = kl_penalty(p.log()[x], q.log()[x], "k3")
    assert k1.mean().item() == pytest.approx(exact, abs=0.01)
    assert k3.mean().item() == pytest.approx(exact, abs=0.01)
    assert k3.var() < k1.var()


def test_unknown_estimator():
    with pytest.raises(ValueError, match="k1, k2, k3, low_var_kl, abs"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "mse")


def test_config():
    cfg = TrainWorkerConfig()
    assert cfg.kl.coef == 0.0 and cfg.kl.type == "low_var_kl" and cfg.kl.ref_offload is False
    assert TrainWorkerConfig(kl={"coef": 0.05, "type": "k2", "ref_offload": True}).kl == KLConfig(
        coef=0.05, type="k2", ref_offload=True)
    with pytest.raises(ValidationError, match="coef"):
        KLConfig(coef=-0.1)
    with pytest.raises(ValidationError, match="type"):
        KLConfig(type="kl")
    with pytest.raises(ValidationError, match="kl_coef"):
        TrainWorkerConfig(kl={"kl_coef": 0.1})
    assert set(KLConfig.model_fields["type"].annotation.__args__) == set(KL_TYPES)
