"""train_worker.head_grad_in_forward: the LM head's gradient computed in the forward pass.

When every token's loss gradient is known before the forward pass, the worker computes the head's
gradient while each chunk of logits exists instead of projecting every chunk again in the backward
pass. The gradients, losses, metrics and updates must be those of the ordinary path."""

from __future__ import annotations

import math

import pytest
import torch

from rlcli.algo.loss import GSPOPolicyLoss, PolicyLoss, VanillaPolicyLoss
from rlcli.train import logprobs as logprobs_mod
from rlcli.train.logprobs import chunked_logprobs, head_value_and_grad_ahead
from rlcli.train.step_loss import head_grad_ahead

from .test_shared_prompts import grouped_batch
from .test_train_worker import assert_same_update, make_worker, model_dir, state  # noqa: F401


def _inputs(n, d=16, v=37, bias=False, temperature=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=gen, requires_grad=True)
    w = torch.randn(v, d, generator=gen, requires_grad=True)
    b = torch.randn(v, generator=gen, requires_grad=True) if bias else None
    labels = torch.randint(0, v, (n,), generator=gen)
    it = torch.rand(n, generator=gen) + 0.5 if temperature else None
    g = torch.randn(n, generator=gen)
    return h, w, b, labels, it, g


def _grads(*tensors):
    return [None if t is None else t.grad.clone() for t in tensors]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [False, True])
@pytest.mark.parametrize("n,chunk", [(23, 5), (23, 64), (0, 4)])
def test_gradient_ahead_equals_the_backward_pass(bias, temperature, n, chunk):
    h, w, b, labels, it, g = _inputs(n, bias=bias, temperature=temperature)
    lp, ent = chunked_logprobs(h, w, b, labels, it, chunk)
    (lp * g).sum().backward()
    expected = _grads(h, w, b)
    for t in (h, w, b):
        if t is not None:
            t.grad = None
    value, lp2, ent2 = head_value_and_grad_ahead(h, w, b, labels, it, g, chunk)
    assert not lp2.requires_grad and not ent2.requires_grad
    assert torch.equal(lp2, lp.detach()) and torch.equal(ent2, ent)
    assert torch.allclose(value, (g * lp.detach()).sum())
    value.backward()
    for got, want in zip(_grads(h, w, b), expected):
        if want is not None:
            assert torch.equal(got, want)  # same chunk math in the same order: bit for bit on the CPU


def test_gradient_ahead_scales_with_the_upstream_gradient():
    h, w, b, labels, it, g = _inputs(11)
    value, _, _ = head_value_and_grad_ahead(h, w, b, labels, it, g, 4)
    (3.0 * value).backward()
    once = _grads(h, w)
    h.grad = w.grad = None
    value, _, _ = head_value_and_grad_ahead(h, w, b, labels, it, g, 4)
    value.backward()
    assert all(torch.allclose(a, 3.0 * b_) for a, b_ in zip(once, _grads(h, w)))


def test_gradient_ahead_checks_its_inputs():
    h, w, b, labels, it, g = _inputs(5)
    with pytest.raises(ValueError, match="grad_logp"):
        head_value_and_grad_ahead(h, w, b, labels, it, g[:3], 4)
    with pytest.raises(ValueError, match="chunk_size"):
        head_value_and_grad_ahead(h, w, b, labels, it, g, 0)


# ---------------------------------------------------------------------- in the worker
@pytest.fixture
def projections(monkeypatch):
    """Counts the LM head's chunk projections."""
    calls = []
    original = logprobs_mod._chunk_logits
    monkeypatch.setattr(logprobs_mod, "_chunk_logits", lambda *a: calls.append(1) or original(*a))
    return calls


CASES = {
    "vanilla": dict(),
    "gspo": dict(loss=GSPOPolicyLoss()),
    "seq-mean": dict(loss=VanillaPolicyLoss(VanillaPolicyLoss.Config(loss_agg="seq-mean-token-mean"))),
    "several-packs": dict(pack_max_length=24),
    "shared-prompts": dict(share_prompts=True, pack_max_length=40),
    "rollout-is-metrics": dict(rollout_is={}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_train_step_is_unchanged(model_dir, projections, case):
    """Same loss, gradient norm, metrics and update as the ordinary path, with every chunk projected
    once instead of twice (temperatures 0.7 and 1, masks with holes, advantages of both signs)."""
    cfg = dict(CASES[case], logprob_chunk_size=7)
    seqs = grouped_batch(groups=4, size=3, seed=3)
    a = make_worker(model_dir, head_grad_in_forward=False, **cfg)
    ma = a.train_step(seqs)
    slow = len(projections)
    projections.clear()
    b = make_worker(model_dir, **cfg)
    mb = b.train_step(seqs)
    assert len(projections) * 2 == slow > 0
    assert mb["train/loss"] == pytest.approx(ma["train/loss"], abs=1e-7)
    assert mb["train/grad_norm"] == pytest.approx(ma["train/grad_norm"], rel=1e-6)
    for key in ("train/entropy", "train/clipfrac", "train/ratio_max", "train/kl_k3", "train/tokens"):
        assert mb[key] == pytest.approx(ma[key], abs=1e-6), key
    if case == "rollout-is-metrics":
        assert mb["mismatch/kl"] == pytest.approx(ma["mismatch/kl"], abs=1e-6)
    assert_same_update(state(a), state(b))
    # and the next step, from the updated weights, agrees as well
    seqs2 = grouped_batch(groups=4, size=3, seed=4)
    assert b.train_step(seqs2)["train/grad_norm"] == pytest.approx(a.train_step(seqs2)["train/grad_norm"], rel=1e-5)


class _NotRatioOnly(PolicyLoss):
    """A loss that reads the logprob's value (an NLL-like term): its gradient is not known ahead."""

    name = "test_not_ratio_only"

    def per_token_loss(self, logp, old_logp, adv, mask, seq_ids=None):
        loss = torch.where(mask, -adv * logp.exp(), 0.0)
        return loss, {}


@pytest.mark.parametrize("cfg,loss,ahead", [
    ({}, None, True),
    ({"rollout_is": {}}, None, True),
    ({"head_grad_in_forward": False}, None, False),
    ({"optimizer_steps": 2}, None, False),
    ({"kl": {"coef": 0.1}}, None, False),
    ({"rollout_is": {"threshold_upper": 2.0}}, None, False),
    ({"rollout_is": {"threshold_upper": 2.0, "mode": "mask"}}, None, False),
    ({"rollout_is": {"veto_upper": 50.0}}, None, False),
    ({}, _NotRatioOnly(), False),
])
def test_used_only_where_the_gradient_is_known_ahead(model_dir, monkeypatch, cfg, loss, ahead):
    recomputed = []  # backward passes of the ordinary head, which project the logits again
    ordinary = logprobs_mod._ChunkedLogprob.backward
    monkeypatch.setattr(logprobs_mod._ChunkedLogprob, "backward",
                        staticmethod(lambda ctx, *g: recomputed.append(1) or ordinary(ctx, *g)))
    w = make_worker(model_dir, loss=loss, logprob_chunk_size=5, **cfg)
    assert head_grad_ahead(w.cfg, w.policy_loss) is ahead
    m = w.train_step(grouped_batch(groups=2, size=2, seed=6))
    assert math.isfinite(m["train/loss"]) and m["train/skipped_steps"] == 0
    assert bool(recomputed) is not ahead


def test_nan_advantage_still_skips_the_step(model_dir):
    seqs = grouped_batch(groups=2, size=2, seed=7)
    seqs[1].advantage = float("nan")
    w = make_worker(model_dir)
    before = state(w)
    m = w.train_step(seqs)
    assert m["train/skipped_steps"] == 1
    assert_same_update(before, state(w))


@pytest.mark.gpu
def test_gradient_ahead_on_cuda_bf16_compiled():
    """The compiled chunk math (stats and gradient in one graph) against the ordinary backward, bf16."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, d, v = 3000, 256, 32000
    kw = dict(device="cuda", dtype=torch.bfloat16)
    h = torch.randn(n, d, generator=gen, **kw).requires_grad_()
    w = (torch.randn(v, d, generator=gen, **kw) * 0.05).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=gen, device="cuda")
    it = torch.rand(n, generator=gen, device="cuda") + 0.5
    g = torch.randn(n, generator=gen, device="cuda")
    lp, ent = chunked_logprobs(h, w, None, labels, it, 1024, fused=True)
    (lp * g).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    value, lp2, ent2 = head_value_and_grad_ahead(h, w, None, labels, it, g, 1024, fused=True)
    value.backward()
    assert logprobs_mod._FUSED.compiled.get("stats_dlogits") is not None and not logprobs_mod._FUSED.broken
    torch.testing.assert_close(lp2, lp.detach(), rtol=0, atol=1e-3)
    torch.testing.assert_close(ent2, ent, rtol=0, atol=1e-3)
    for got, want in ((h.grad, gh), (w.grad, gw)):
        rel = (got.float() - want.float()).norm() / want.float().norm()
        assert rel < 1e-2, rel.item()
