"""TrainWorker's training step on one process: a step raises the logprobs of rewarded tokens and reports
its metrics, compute_logprobs matches a plain Hugging Face forward, packed and padded layouts, Dr. GRPO's
aggregation, several optimizer steps, GSPO, gradient checkpointing and the activation memory budget,
gradient clipping and the AdamW step on local shards, the non-finite step guard, and batches with
nothing to train on. The fixtures and helpers come from test_train_worker.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from rlcli.algo.loss import GSPOPolicyLoss
from rlcli.config import TrainWorkerConfig
from rlcli.train.data import TrainSequence

from .test_train_worker import EXPECTED_KEYS, _dr_grpo_loss, assert_same_update, make_batch, make_worker, state
from .test_train_worker import model_dir  # noqa: F401  (a fixture: pytest finds it by name)


# --------------------------------------------------------------------------- training
def test_train_step_raises_logprob_of_rewarded_tokens(model_dir):
    w = make_worker(model_dir)
    seqs = make_batch()
    pos = [i for i, s in enumerate(seqs) if s.advantage > 0]
    neg = [i for i, s in enumerate(seqs) if s.advantage < 0]
    before = w.compute_logprobs(seqs)
    m = w.train_step(seqs)
    assert EXPECTED_KEYS <= set(m)
    n_tokens = sum(len(s.response_ids) for s in seqs)
    assert m["train/tokens"] == n_tokens and m["train/skipped_steps"] == 0
    # optimizer_steps=1: old logprobs are the current ones, so ratio == 1, kl == 0, loss == -mean(A)
    assert m["train/ratio_max"] == m["train/ratio_min"] == 1.0
    assert m["train/kl_k3"] == 0.0 and m["train/clipfrac"] == 0.0
    mean_adv = sum(s.advantage * len(s.response_ids) for s in seqs) / n_tokens
    assert m["train/loss"] == pytest.approx(-mean_adv, abs=1e-6)
    assert m["train/lr"] == pytest.approx(1e-2)
    assert 0 < m["train/grad_norm"] < 1e3
    assert 0 < m["train/entropy"] <= math.log(53) + 1e-4
    flat_before = [lp for s in before for lp in s]
    assert m["train/rollout_logprob_diff"] == pytest.approx(sum(abs(x + 3.5) for x in flat_before) / n_tokens, abs=1e-4)
    for _ in range(4):
        w.train_step(seqs)
    after = w.compute_logprobs(seqs)
    assert all(after[i][0] > before[i][0] for i in pos)
    assert sum(after[i][0] - before[i][0] for i in neg) < 0


def test_compute_logprobs_match_plain_hf_forward(model_dir):
    from transformers import AutoModelForCausalLM

    w = make_worker(model_dir, pack_max_length=16, logprob_chunk_size=3)
    seqs = make_batch(n=10, seed=3)
    seqs[1].temperature, seqs[2].temperature, seqs[3].response_mask[0] = 0.6, 0.0, 0
    got = w.compute_logprobs(seqs)
    plain = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        for s, lps in zip(seqs, got):
            logits = plain(input_ids=torch.tensor([s.prompt_ids + s.response_ids[:-1]])).logits[0]
            lp = F.log_softmax(logits / s.effective_temperature, -1)
            p = len(s.prompt_ids)
            ref = [lp[p - 1 + j, r].item() for j, r in enumerate(s.response_ids)]
            assert lps == pytest.approx(ref, abs=1e-5)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_layouts_train_identically(model_dir, layout):
    seqs = make_batch(n=12, seed=5)
    ref = make_worker(model_dir, pack_max_length=40, pack_layout="padded")
    w = make_worker(model_dir, pack_max_length=40, pack_layout=layout)
    a, b = ref.train_step(seqs), w.train_step(seqs)
    assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-6)
    assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-5)
    assert_same_update(state(ref), state(w))


def test_dr_grpo_aggregation_by_hand_whatever_the_packing(model_dir):
    """Dr. GRPO's seq-mean-token-sum-norm (the other modes: tests/test_loss.py): the step loss is the
    hand-computed one (ratio 1: each token's loss is -A) with a fully masked sequence in the batch,
    and the update is the same in one pack or many, with or without the head's gradient ahead."""
    seqs = make_batch(n=12, seed=11)
    seqs[3].response_mask = [0] * len(seqs[3].response_ids)  # fully masked: in no count
    seqs[4].response_ids, seqs[4].response_mask, seqs[4].rollout_logprobs = [7, 9, 11], [1, 0, 1], [-3.5] * 3
    kept = [(s.advantage, sum(s.response_mask)) for s in seqs if sum(s.response_mask)]
    hand = sum(-a * n for a, n in kept) / len(kept) / 5.0
    configs = [dict(pack_max_length=64), dict(pack_max_length=12, logprob_chunk_size=3),
               dict(pack_max_length=12, head_grad_in_forward=False)]
    workers = [make_worker(model_dir, loss=_dr_grpo_loss(), **cfg) for cfg in configs]
    metrics = [w.train_step(seqs) for w in workers]
    assert metrics[0]["train/micro_batches"] == 1 < metrics[1]["train/micro_batches"]
    for m in metrics:
        assert m["train/loss"] == pytest.approx(hand, abs=1e-6)
        assert m["train/sequences"] == len(kept) == 11
    for w in workers[1:]:
        assert_same_update(state(workers[0]), state(w))


def test_multiple_optimizer_steps(model_dir):
    w = make_worker(model_dir, optimizer_steps=3, lr_scheduler={"name": "linear"}, total_steps=2)
    seqs = make_batch(n=30, seed=1)
    m = w.train_step(seqs)
    assert w.optimizer_steps_done == 3
    assert m["train/skipped_steps"] == 0
    # later mini-batches see a policy that moved: the ratio departs from 1 and the KL is positive
    assert m["train/ratio_max"] > 1.0 or m["train/ratio_min"] < 1.0
    assert m["train/kl_k3"] > 0
    assert m["train/lr"] == pytest.approx(1e-2 * (1 - 2 / 6))  # LR of the third update out of 6


def test_gspo_loss_trains(model_dir):
    w = make_worker(model_dir, loss=GSPOPolicyLoss(), optimizer_steps=2)
    m = w.train_step(make_batch(n=20, seed=2))
    assert m["train/skipped_steps"] == 0 and math.isfinite(m["train/loss"])


def test_gradient_checkpointing_gives_same_update(model_dir):
    seqs = make_batch(n=16, seed=4)
    a, b = make_worker(model_dir), make_worker(model_dir, gradient_checkpointing=True)
    ma, mb = a.train_step(seqs), b.train_step(seqs)
    assert ma["train/grad_norm"] == pytest.approx(mb["train/grad_norm"], rel=1e-5)
    assert_same_update(state(a), state(b))


def _saved_activation_bytes(worker, seqs) -> int:
    """Bytes the autograd graph keeps for backward during one forward of the first micro-batch."""
    mb = worker._micro_batches(seqs, [list(range(len(seqs)))])[0][0]
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = worker._forward(mb)
    logp.sum().backward()
    worker.optimizer.zero_grad(set_to_none=True)
    return total


def test_activation_memory_budget_recomputes_in_compiled_layers(model_dir):
    """The budget makes the compiled layers keep fewer activations, the update stays the same, and a
    worker built later in the same process with another budget gets its own compilation."""
    seqs = make_batch(n=16, seed=4)
    full = make_worker(model_dir, fsdp={"torch_compile": True})
    lean = make_worker(model_dir, fsdp={"torch_compile": True, "activation_memory_budget": 0.0})
    again = make_worker(model_dir, fsdp={"torch_compile": True})
    kept = [_saved_activation_bytes(w, seqs) for w in (full, lean, again)]
    assert kept[1] < 0.7 * kept[0], kept
    assert kept[2] == kept[0], kept
    ma, mb = full.train_step(seqs), lean.train_step(seqs)
    assert ma["train/grad_norm"] == pytest.approx(mb["train/grad_norm"], rel=1e-5)
    assert_same_update(state(full), state(lean))


def test_activation_memory_budget_needs_torch_compile():
    with pytest.raises(ValueError, match="activation_memory_budget=0.5 needs torch_compile"):
        TrainWorkerConfig(fsdp={"activation_memory_budget": 0.5})


@pytest.mark.parametrize("max_norm", [1e-3, 1e6, math.inf])
def test_grad_clipping_on_local_shards_matches_the_full_gradient(model_dir, max_norm):
    from rlcli.train.optim import clip_grad_norm_local

    w = make_worker(model_dir)
    seqs = make_batch(n=8)
    logp, _ = w._forward(w._micro_batches(seqs, [list(range(8))])[0][0])
    logp.sum().backward()
    grads = [p.grad for p in w.model.parameters() if p.grad is not None]
    assert grads and all(isinstance(g, DTensor) for g in grads)  # FSDP's sharded gradients
    full = [g.full_tensor().clone() for g in grads]
    want = torch.cat([f.flatten() for f in full]).norm().item()
    got = float(clip_grad_norm_local(grads, max_norm, None))
    assert got == pytest.approx(want, rel=1e-5)
    scale = min(1.0, max_norm / (want + 1e-6))
    for g, f in zip(grads, full):
        assert torch.allclose(g.full_tensor(), f * scale, rtol=1e-5, atol=0)
    # plain tensors (replicated), and a non-finite gradient reports a non-finite norm
    plain = [torch.tensor([3.0, 4.0]), torch.tensor([12.0])]
    assert float(clip_grad_norm_local(plain, 6.5, None)) == pytest.approx(13.0)
    assert torch.allclose(torch.cat(plain), torch.tensor([1.5, 2.0, 6.0]), rtol=1e-5)
    assert not math.isfinite(clip_grad_norm_local([torch.tensor([float("nan")])], 1.0, None))


def test_nan_advantage_skips_the_step(model_dir):
    w = make_worker(model_dir)
    seqs = make_batch(n=8)
    seqs[3].advantage = float("nan")
    before = state(w)
    m = w.train_step(seqs)
    assert m["train/skipped_steps"] == 1
    assert math.isnan(m["train/loss"])
    after = state(w)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not w.optimizer.state  # AdamW never stepped
    assert all(p.grad is None for p in w.model.parameters())
    assert w.optimizer_steps_done == 1  # the schedule still advances
    seqs[3].advantage = 1.0
    assert w.train_step(seqs)["train/skipped_steps"] == 0


def _moments(worker) -> dict[str, torch.Tensor]:
    out = {}
    for i, p in enumerate(worker.model.parameters()):
        for k, v in worker.optimizer.state.get(p, {}).items():
            out[f"{i}.{k}"] = (v.full_tensor() if isinstance(v, DTensor) else v).clone()
    return out


def test_optimizer_step_on_local_shards_equals_adamw_step(model_dir, monkeypatch):
    import rlcli.train.worker as W

    taken = []
    real = W.adamw_step_local
    monkeypatch.setattr(W, "adamw_step_local", lambda opt, inf: taken.append(real(opt, inf)) or taken[-1])
    fast = make_worker(model_dir, max_grad_norm=0.05)
    slow = make_worker(model_dir, max_grad_norm=0.05)
    batches = [make_batch(n=16, seed=s) for s in range(3)]
    for seqs in batches:
        ma = fast.train_step(seqs)
        monkeypatch.setattr(W, "adamw_step_local", lambda opt, inf: False)  # torch's own AdamW.step()
        mb = slow.train_step(seqs)
        monkeypatch.setattr(W, "adamw_step_local", lambda opt, inf: taken.append(real(opt, inf)) or taken[-1])
        assert ma["train/loss"] == mb["train/loss"] and ma["train/grad_norm"] == mb["train/grad_norm"]
    assert taken == [False, True, True]  # the first step creates the moments the usual way
    sa, sb = state(fast), state(slow)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # bit for bit
    ma, mb = _moments(fast), _moments(slow)
    assert ma.keys() == mb.keys() and ma and all(torch.equal(ma[k], mb[k]) for k in ma)


def test_a_non_finite_step_after_the_first_is_skipped_on_the_device(model_dir):
    w, ref = make_worker(model_dir), make_worker(model_dir)
    good, bad = make_batch(n=8, seed=1), make_batch(n=8, seed=2)
    bad[3].advantage = float("nan")
    for x in (w, ref):
        x.train_step(good)
    before, moments = state(w), _moments(w)
    m = w.train_step(bad)
    assert m["train/skipped_steps"] == 1 and math.isnan(m["train/loss"])
    after = state(w)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(v, _moments(w)[k]) for k, v in moments.items())  # the step count too
    assert all(p.grad is None for p in w.model.parameters())
    # the skipped step left no trace: the next update is the one a run without it makes
    ref.scheduler.step()  # the schedule advances on a skipped step
    w.train_step(good)
    ref.train_step(good)
    sa, sb = state(w), state(ref)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_no_valid_tokens_is_a_no_op(model_dir):
    w = make_worker(model_dir)
    seqs = make_batch(n=4)
    for s in seqs:
        s.response_mask = [0] * len(s.response_ids)
    before = state(w)
    m = w.train_step(seqs)
    assert m["train/tokens"] == 0 and m["train/loss"] == 0.0 and m["train/skipped_steps"] == 0
    after = state(w)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_batch_without_a_trainable_sequence_changes_nothing(model_dir):
    # the empty-batch case: groups whose members failed or have no response give no training
    # sequence; the step then moves no weight, reports finite zeros and still advances the LR schedule
    from rlcli.algo.advantage import GRPOAdvantage
    from rlcli.runner.sequences import sequences_from_groups
    from rlcli.types import Group, Sample, Status

    failed = Sample(uid=0, group_id=0, task_name="t", prompt_ids=[5, 6], response_ids=[7], logprobs=[-1.0],
                    status=Status.FAILED)
    empty = Sample(uid=1, group_id=1, task_name="t", prompt_ids=[5, 6], status=Status.COMPLETED, reward={"score": 1.0})
    seqs, adv = sequences_from_groups([Group(0, "t", [failed]), Group(1, "t", [empty])], GRPOAdvantage())
    assert seqs == [] and adv == []
    w = make_worker(model_dir)
    before = state(w)
    m = w.train_step(seqs)
    assert m["train/tokens"] == m["train/sequences"] == m["train/loss"] == m["train/grad_norm"] == 0.0
    assert all(math.isfinite(v) for v in m.values()) and m["train/skipped_steps"] == 0
    assert w.scheduler.last_epoch == 1
    after = state(w)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_too_long_sequence_is_rejected(model_dir):
    w = make_worker(model_dir, pack_max_length=4)
    with pytest.raises(ValueError, match="pack_max_length=4"):
        w.train_step([TrainSequence([5, 6, 7, 8], [9, 10], [1, 1], None, 1.0)])
