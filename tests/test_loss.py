"""Policy losses against hand-written reference formulas (XTuner acceptance 45, 46, 47)."""

from __future__ import annotations

import math
import random
from typing import ClassVar

import pytest
import torch
from pydantic import ValidationError

from rlcli import hookimpl
from rlcli.algo.loss import GSPOPolicyLoss, PolicyLoss, VanillaPolicyLoss, aggregation_weights
from rlcli.plugins import get_registry


def _vanilla(**kw) -> VanillaPolicyLoss:
    return VanillaPolicyLoss(VanillaPolicyLoss.Config(**kw))


def _ref_vanilla(lp: float, old: float, a: float, low=0.2, high=0.28, c=3.0, dmin=-20.0, dmax=20.0) -> float:
    r = math.exp(min(max(lp - old, dmin), dmax))
    loss = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
    if c is not None and a < 0:
        loss = min(loss, -a * c)
    return loss


def test_registered_with_configs():
    reg = get_registry()
    assert reg.get("policy_loss", "vanilla") is VanillaPolicyLoss
    assert reg.get("policy_loss", "gspo") is GSPOPolicyLoss
    for cls in (VanillaPolicyLoss, GSPOPolicyLoss):
        assert cls.__doc__.strip() and "\n" not in cls.__doc__.strip()
        assert all(f.description for f in cls.Config.model_fields.values())
    assert VanillaPolicyLoss().loss_agg == "token-mean"
    assert GSPOPolicyLoss().loss_agg == "seq-mean-token-mean"


@pytest.mark.parametrize("adv,ratio,expected",
                         [(1.0, 1.5, -1.28), (1.0, 0.5, -0.5), (-1.0, 0.5, 0.8), (-1.0, 5.0, 3.0)])
def test_vanilla_acceptance_45(adv, ratio, expected):
    logp = torch.tensor([math.log(ratio)])
    loss, _ = _vanilla().per_token_loss(logp, torch.zeros(1), torch.tensor([adv]), torch.ones(1, dtype=torch.bool))
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_vanilla_matches_reference_and_gradient():
    rng = random.Random(0)
    n = 200
    lp = [rng.uniform(-4, 0) for _ in range(n)]
    old = [x + rng.uniform(-1.5, 1.5) for x in lp]
    adv = [rng.uniform(-2, 2) for _ in range(n)]
    for kw in [{}, {"clip_ratio_c": None}, {"clip_low": 0.1, "clip_high": 0.1, "clip_ratio_c": 1.5}]:
        cfg = VanillaPolicyLoss.Config(**kw)
        logp = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
        loss, _ = VanillaPolicyLoss(cfg).per_token_loss(
            logp, torch.tensor(old, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64),
            torch.ones(n, dtype=torch.bool))
        ref = [_ref_vanilla(a, b, c, cfg.clip_low, cfg.clip_high, cfg.clip_ratio_c) for a, b, c in zip(lp, old, adv)]
        assert loss.tolist() == pytest.approx(ref, abs=1e-9)
        loss.sum().backward()
        # d/dlogp of -A*r is -A*r where the unclipped branch is active, else 0
        for i in range(n):
            r = math.exp(lp[i] - old[i])
            unclipped = -adv[i] * r
            grad = -adv[i] * r if abs(ref[i] - unclipped) < 1e-12 else 0.0
            assert logp.grad[i].item() == pytest.approx(grad, abs=1e-9)


def test_log_ratio_is_clamped_before_exp():
    loss, m = _vanilla(clip_ratio_c=None).per_token_loss(
        torch.tensor([100.0, -100.0]), torch.zeros(2), torch.tensor([-1.0, 1.0]), torch.ones(2, dtype=torch.bool))
    assert torch.isfinite(loss).all()
    assert loss[0].item() == pytest.approx(math.exp(20.0), rel=1e-5)
    assert m["ratio_max"].item() == pytest.approx(math.exp(20.0), rel=1e-5)
    assert m["ratio_min"].item() == pytest.approx(math.exp(-20.0), rel=1e-5)


def test_metrics_over_valid_tokens_only():
    ratios = [0.5, 1.0, 1.5, 2.0]
    logp = torch.tensor([math.log(r) for r in ratios])
    mask = torch.tensor([True, True, True, False])
    loss, m = _vanilla().per_token_loss(logp, torch.zeros(4), torch.tensor([1.0, 1.0, -1.0, float("nan")]), mask)
    assert loss[3].item() == 0.0  # masked: 0 even with a NaN advantage
    assert m["clipfrac_low"].item() == pytest.approx(1 / 3)
    assert m["clipfrac_high"].item() == pytest.approx(1 / 3)
    assert m["clipfrac"].item() == pytest.approx(2 / 3)
    assert m["ratio_max"].item() == pytest.approx(1.5)
    assert m["ratio_min"].item() == pytest.approx(0.5)
    assert m["ratio_mean"].item() == pytest.approx(1.0)
    lr = [math.log(r) for r in ratios[:3]]
    assert m["kl_k1"].item() == pytest.approx(sum(-x for x in lr) / 3, abs=1e-6)
    assert m["kl_k3"].item() == pytest.approx(sum(math.exp(x) - 1 - x for x in lr) / 3, abs=1e-6)
    assert all(not v.requires_grad for v in m.values())


def test_zero_valid_tokens_acceptance_46():
    mask = torch.zeros(3, dtype=torch.bool)
    logp = torch.zeros(3, requires_grad=True)
    loss, m = _vanilla().per_token_loss(logp, torch.zeros(3), torch.ones(3), mask)
    w = aggregation_weights("token-mean", mask, None, 0, 0)
    total = (loss * w).sum()
    assert total.item() == 0.0
    total.backward()
    assert logp.grad.tolist() == [0.0, 0.0, 0.0]
    assert all(math.isfinite(m[k].item()) for k in m if not k.endswith(("_max", "_min")))
    assert m["ratio_max"].item() == -math.inf and m["ratio_min"].item() == math.inf
    none = torch.zeros(0, dtype=torch.bool)
    empty, _ = _vanilla().per_token_loss(torch.zeros(0), torch.zeros(0), torch.zeros(0), none)
    assert empty.shape == (0,)


def test_aggregation_weights():
    mask = torch.tensor([True, True, False, True, True, True])
    seq = torch.tensor([7, 7, 7, 3, 3, 9])
    w = aggregation_weights("token-mean", mask, seq, num_tokens=10, num_seqs=4)
    assert w.tolist() == pytest.approx([0.1, 0.1, 0.0, 0.1, 0.1, 0.1])
    w = aggregation_weights("seq-mean-token-mean", mask, seq, num_tokens=10, num_seqs=4)
    # seq 7: 2 valid tokens, seq 3: 2, seq 9: 1; 4 sequences in the whole step
    assert w.tolist() == pytest.approx([1 / 8, 1 / 8, 0.0, 1 / 8, 1 / 8, 1 / 4])
    with pytest.raises(ValueError, match="loss_agg"):
        aggregation_weights("sum", mask, seq, 1, 1)


# per-token losses 1..8 of four sequences; sequence 5 is fully masked, and one token of 7 is masked
_LOSS = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
_MASK = torch.tensor([True, True, False, True, True, True, False, False])
_SEQ = torch.tensor([7, 7, 7, 3, 3, 9, 5, 5])
# by hand, over the kept tokens: sequence sums 7: 1+2, 3: 4+5, 9: 6; three sequences count (not 5)
_HAND = {
    "token-mean": (1 + 2 + 4 + 5 + 6) / 5,
    "seq-mean-token-mean": ((1 + 2) / 2 + (4 + 5) / 2 + 6) / 3,
    "seq-mean-token-sum": (3 + 9 + 6) / 3,
    "seq-mean-token-sum-norm": (3 + 9 + 6) / 3 / 4,  # loss_scale_factor 4
}


@pytest.mark.parametrize("agg", list(_HAND))
def test_aggregation_by_hand_and_independent_of_the_micro_batch_split(agg):
    """The step loss of every mode equals the hand-computed value, with a fully masked sequence in
    the batch, and the micro-batches' shares (each weighted with the step's global counts) add up to
    it however the sequences are split."""
    def share(sel: list[int]) -> float:
        idx = torch.tensor(sel)
        w = aggregation_weights(agg, _MASK[idx], _SEQ[idx], num_tokens=5, num_seqs=3, scale_factor=4.0)
        assert torch.isfinite(w).all()
        return float((_LOSS[idx] * w).sum())

    whole = share(list(range(8)))
    assert whole == pytest.approx(_HAND[agg], abs=1e-6)
    for split in ([[0, 1, 2, 6, 7], [3, 4, 5]], [[0, 1, 2], [3, 4], [5], [6, 7]], [[6, 7], [0, 1, 2, 3, 4, 5]]):
        assert sum(share(part) for part in split) == pytest.approx(whole, abs=1e-6)
    alone = aggregation_weights(agg, _MASK[6:], _SEQ[6:], num_tokens=5, num_seqs=3, scale_factor=4.0)
    assert alone.tolist() == [0.0, 0.0]  # the fully masked sequence on its own: weight 0, no NaN


def test_sum_modes_weights_and_scale_factor():
    w = aggregation_weights("seq-mean-token-sum", _MASK, None, num_tokens=10, num_seqs=4)
    assert w.tolist() == pytest.approx([0.25, 0.25, 0.0, 0.25, 0.25, 0.25, 0.0, 0.0])
    w = aggregation_weights("seq-mean-token-sum-norm", _MASK, None, 10, 4, scale_factor=8)
    assert w.tolist() == pytest.approx([1 / 32, 1 / 32, 0.0, 1 / 32, 1 / 32, 1 / 32, 0.0, 0.0])
    assert aggregation_weights("seq-mean-token-sum", _MASK, None, 0, 0).tolist() == _MASK.float().tolist()
    with pytest.raises(ValueError, match="loss_scale_factor"):
        aggregation_weights("seq-mean-token-sum-norm", _MASK, None, 10, 4)
    loss = _vanilla(loss_agg="seq-mean-token-sum-norm", loss_scale_factor=8)
    assert (loss.loss_agg, loss.loss_scale_factor) == ("seq-mean-token-sum-norm", 8.0)
    assert GSPOPolicyLoss(GSPOPolicyLoss.Config(loss_agg="seq-mean-token-sum")).loss_scale_factor is None
    with pytest.raises(ValidationError, match="only applies"):
        VanillaPolicyLoss.Config(loss_scale_factor=8)
    with pytest.raises(ValidationError):
        VanillaPolicyLoss.Config(loss_agg="seq-mean-token-sum-norm", loss_scale_factor=0)


def test_gspo_matches_sequence_level_reference():
    rng = random.Random(1)
    lens = [3, 1, 4, 2]
    seq_ids = torch.tensor([i for i, n in enumerate(lens) for _ in range(n)])
    n = len(seq_ids)
    lp = torch.tensor([rng.uniform(-3, -0.1) for _ in range(n)], dtype=torch.float64)
    old = lp + torch.tensor([rng.uniform(-1e-3, 1e-3) for _ in range(n)], dtype=torch.float64)
    adv_seq = [1.0, -0.5, 2.0, -1.0]
    adv = torch.tensor([adv_seq[i] for i in seq_ids.tolist()], dtype=torch.float64)
    mask = torch.ones(n, dtype=torch.bool)
    mask[2] = False
    loss_fn = GSPOPolicyLoss()
    logp = lp.clone().requires_grad_(True)
    loss, m = loss_fn.per_token_loss(logp, old, adv, mask, seq_ids)
    total = (loss * aggregation_weights(loss_fn.loss_agg, mask, seq_ids, int(mask.sum()), len(lens))).sum()
    total.backward()

    # Reference: J = mean_i max(-A_i s_i, -A_i clip(s_i)), s_i = exp(mean over valid t of (lp - old)).
    lp_ref = lp.clone().requires_grad_(True)
    terms = []
    for i in range(len(lens)):
        sel = (seq_ids == i) & mask
        s = torch.exp((lp_ref[sel] - old[sel]).mean())
        a = adv_seq[i]
        terms.append(torch.maximum(-a * s, -a * s.clamp(1 - 3e-4, 1 + 4e-4)))
    ref = torch.stack(terms).mean()
    ref.backward()
    assert total.item() == pytest.approx(ref.item(), abs=1e-12)
    assert torch.allclose(logp.grad, lp_ref.grad, atol=1e-12)
    assert loss[2].item() == 0.0
    assert m["ratio_max"].item() >= m["ratio_min"].item()
    with pytest.raises(ValueError, match="seq_ids"):
        loss_fn.per_token_loss(logp, old, adv, mask)


def test_config_validation():
    with pytest.raises(ValidationError):
        VanillaPolicyLoss.Config(clip_low=1.5)
    with pytest.raises(ValidationError):
        VanillaPolicyLoss.Config(clip_ratio_c=0.5)
    with pytest.raises(ValidationError, match="log_prob_diff_min"):
        VanillaPolicyLoss.Config(log_prob_diff_min=1.0, log_prob_diff_max=0.0)
    with pytest.raises(ValidationError):
        VanillaPolicyLoss.Config(loss_agg="sum")
    with pytest.raises(ValidationError):
        VanillaPolicyLoss.Config(cliprange_low=0.2)
    assert VanillaPolicyLoss.Config(clip_ratio_c=None).clip_ratio_c is None


# ------------------------------------------------------------------ acceptance 47: choosing a loss
def _quickstart(repo, **loss):
    import yaml

    raw = yaml.safe_load((repo / "recipes" / "quickstart.yaml").read_text())
    raw["train_worker"]["loss"] = loss
    return raw


def test_unknown_loss_and_xtuner_keys_are_rejected_with_the_supported_names(repo):
    from rlcli.config import RecipeError, validate_recipe

    with pytest.raises(RecipeError, match=r"loss.name: unknown policy_loss 'ppo'; available: gspo, vanilla"):
        validate_recipe(_quickstart(repo, name="ppo"), base_dir=repo / "recipes")
    # XTuner's key names are not silently ignored
    with pytest.raises(RecipeError, match=r"cliprange_low: unknown key \(did you mean 'clip_low'\?\)"):
        validate_recipe(_quickstart(repo, name="vanilla", cliprange_low=0.2), base_dir=repo / "recipes")


class ReinforceLoss(PolicyLoss):
    """REINFORCE without a ratio: -A * logp (a third-party loss for the plugin test)."""

    name: ClassVar[str] = "reinforce_test"

    def per_token_loss(self, logp, old_logp, adv, mask, seq_ids=None):
        return torch.where(mask.bool(), -adv * logp, 0.0), {}


class LossPlugin:
    """XTuner loads a custom loss function from a dotted path; rlcli from a plugin, chosen by name."""

    @hookimpl
    def register_policy_losses(self):
        return [ReinforceLoss]


def test_a_plugin_loss_is_chosen_by_name(repo):
    from rlcli.config import validate_recipe
    from rlcli.plugins import registry_with

    rec = validate_recipe(_quickstart(repo, name="reinforce_test"), registry=registry_with(LossPlugin()),
                          base_dir=repo / "recipes")
    loss_fn = rec.train_worker.loss.build()
    assert isinstance(loss_fn, ReinforceLoss) and loss_fn.loss_agg == "token-mean"
    out, _ = loss_fn.per_token_loss(torch.tensor([-1.0, -2.0]), torch.zeros(2), torch.tensor([2.0, 1.0]),
                                    torch.tensor([True, False]))
    assert out.tolist() == [2.0, 0.0]
