"""train_worker.share_prompts: each prompt run once for all of its responses (the ``shared`` layout).

The layout must change nothing but the cost: logprobs, entropies, gradients and updates equal those
of the ordinary layouts up to floating-point order, for every policy-loss path the worker has."""

from __future__ import annotations

import json
import random

import pytest
import torch

from rlcli.config import TrainWorkerConfig
from rlcli.train.data import (
    TrainSequence,
    build_micro_batch,
    pack_balanced,
    pack_shared,
    prompt_groups,
)

from .test_train_worker import make_worker, model_dir, state, untied_dir  # noqa: F401


def shared_tokens(seqs: list[TrainSequence], members: list[int]) -> int:
    """Input tokens of sequences with one prompt in the shared layout: the prompt once, then each
    ``response[:-1]`` (what pack_shared counts)."""
    return len(seqs[members[0]].prompt_ids) + sum(len(seqs[i].response_ids) - 1 for i in members)


def grouped_batch(groups=6, size=4, seed=0, vocab=53, partial=True) -> list[TrainSequence]:
    """``groups`` prompts of 2-9 tokens, ``size`` responses of 1-12 tokens each, advantages of both
    signs, some response masks with holes (a tool's tokens, say), two temperatures."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(2, 9))]
        for k in range(size):
            resp = [rng.randrange(4, vocab) for _ in range(rng.randint(1, 12))]
            mask = [1] * len(resp)
            if partial and k == 1 and len(resp) > 3:
                mask[0] = mask[2] = 0
            out.append(TrainSequence(prompt, resp, mask, [rng.uniform(-4, -1) for _ in resp], rng.uniform(-1, 1),
                                     temperature=0.7 if g % 2 else 1.0, seq_id=len(out)))
    return out


# ------------------------------------------------------------------------------ packing
def test_pack_shared_keeps_a_prompts_sequences_together_and_counts_the_prompt_once():
    seqs = grouped_batch(groups=5, size=4, seed=1)
    limit = max(shared_tokens(seqs, list(range(g * 4, g * 4 + 4))) for g in range(5)) + 3
    packs = pack_shared(seqs, limit)
    assert sorted(i for p in packs for i in p.indices) == list(range(20))
    for p in packs:
        members = prompt_groups(seqs, p.indices)
        assert sum(shared_tokens(seqs, m) for m in members) <= limit
        assert all(len(m) == 4 for m in members)  # no group was split: each fits whole
    # no more packs than when each prompt is counted once per sequence, and fewer tokens in them
    assert len(packs) <= len(pack_balanced(seqs, limit))
    shared = sum(shared_tokens(seqs, m) for p in packs for m in prompt_groups(seqs, p.indices))
    assert shared == sum(s.num_tokens for s in seqs) - 3 * sum(len(seqs[g * 4].prompt_ids) for g in range(5))
    assert pack_shared(seqs, limit) == packs  # deterministic


def test_pack_shared_splits_a_group_too_long_for_one_pack():
    prompt = list(range(4, 14))  # 10 tokens
    seqs = [TrainSequence(prompt, [5] * 8, [1] * 8, None, 1.0, seq_id=i) for i in range(5)]  # 7 inputs each
    packs = pack_shared(seqs, 30)  # 10 + 7 * 2 = 24 fits, a third response would need 31
    assert [p.indices for p in packs] == [[0, 1], [2, 3], [4]]
    assert all(sum(shared_tokens(seqs, m) for m in prompt_groups(seqs, p.indices)) <= 30 for p in packs)
    with pytest.raises(ValueError, match="sequence 0 has 17 input tokens.*pack_max_length=16"):
        pack_shared(seqs, 16)


def test_shared_micro_batch_rows_rebuild_each_sequence():
    """Every sequence's attention row holds exactly its prompt and response inputs at positions
    0..n-1; every token is owned by a row position that holds it; every label sits where that
    sequence's own row predicts it."""
    seqs = grouped_batch(groups=3, size=4, seed=2)
    (pack,) = pack_shared(seqs, 10_000)
    mb = build_micro_batch(seqs, pack, "shared")
    ids, pos = mb.input_ids[0], mb.position_ids[0]
    assert ids.numel() == sum(shared_tokens(seqs, m) for m in prompt_groups(seqs, pack.indices))
    flat = mb.attn_rows.reshape(-1)
    assert torch.equal(flat[mb.attn_owner], torch.arange(ids.numel()))
    width = mb.attn_rows.shape[1]
    start = 0
    for r, i in enumerate(pack.indices):
        s = seqs[i]
        n = s.num_tokens
        row = mb.attn_rows[r, :n]
        assert ids[row].tolist() == s.prompt_ids + s.response_ids[:-1]
        assert pos[row].tolist() == list(range(n))
        js = [j for j, m in enumerate(s.response_mask) if m]
        got = mb.label_index[start:start + len(js)]
        assert got.tolist() == [int(mb.attn_rows[r, len(s.prompt_ids) - 1 + j]) for j in js]
        assert mb.labels[start:start + len(js)].tolist() == [s.response_ids[j] for j in js]
        start += len(js)
        # owners of this row's response tokens are in this row
        resp = row[len(s.prompt_ids):]
        assert torch.equal(mb.attn_owner[resp] // width, torch.full_like(resp, r))
    assert start == mb.num_labels


def test_models_the_shared_layout_cannot_serve_are_refused(tmp_path):
    from rlcli.models import tiny_model_dir

    path = tiny_model_dir(tmp_path / "m", arch="qwen2", seed=0)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=4, layer_types=["full_attention", "sliding_attention"])
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="share_prompts: Qwen2ForCausalLM has attention layers other than full"):
        make_worker(path, share_prompts=True)


def test_share_prompts_needs_the_auto_layout():
    with pytest.raises(ValueError, match="share_prompts.*pack_layout='padded'"):
        TrainWorkerConfig(share_prompts=True, pack_layout="padded")


# ---------------------------------------------------------------------------- attention
def test_row_gathers_backward_as_plain_indexing():
    """The hand-written backward passes of the attention gathers equal autograd's for index_select:
    keys/values sum over every copy; queries take their owner's gradient when the other copies'
    gradients are zero (attention gives a query with no output gradient none); outputs copy back."""
    from rlcli.train.attention import _GatherRows, _TakeOwned

    seqs = grouped_batch(groups=3, size=3, seed=9)
    (pack,) = pack_shared(seqs, 10_000)
    mb = build_micro_batch(seqs, pack, "shared")
    flat, owner = mb.attn_rows.reshape(-1), mb.attn_owner
    tokens = torch.randn(owner.numel(), 2, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(flat.numel(), 2, 4, dtype=torch.float64)
    (want,) = torch.autograd.grad(tokens.index_select(0, flat), tokens, g)
    (got,) = torch.autograd.grad(_GatherRows.apply(tokens, flat, None), tokens, g)
    assert torch.allclose(got, want)
    only_owned = torch.zeros_like(g).index_copy(0, owner, g.index_select(0, owner))
    (want,) = torch.autograd.grad(tokens.index_select(0, flat), tokens, only_owned)
    (got,) = torch.autograd.grad(_GatherRows.apply(tokens, flat, owner), tokens, only_owned)
    assert torch.equal(got, want)
    rows = torch.randn(flat.numel(), 2, 4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(owner.numel(), 2, 4, dtype=torch.float64)
    (want,) = torch.autograd.grad(rows.index_select(0, owner), rows, g)
    (got,) = torch.autograd.grad(_TakeOwned.apply(rows, owner), rows, g)
    assert torch.equal(got, want)


# ------------------------------------------------------------------------------- model
@pytest.mark.parametrize("fixture", ["model_dir", "untied_dir"])
def test_shared_logprobs_equal_the_unshared(fixture, request):
    path = request.getfixturevalue(fixture)
    seqs = grouped_batch(seed=3)
    plain, shared = make_worker(path), make_worker(path, share_prompts=True)
    a, b = plain.compute_logprobs(seqs), shared.compute_logprobs(seqs)
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), atol=2e-5, rtol=0)
    # the shared run did feed fewer tokens to the model
    (mbs,) = shared._micro_batches(seqs, [list(range(len(seqs)))])
    (mbp,) = plain._micro_batches(seqs, [list(range(len(seqs)))])
    assert all(mb.layout == "shared" for mb in mbs)
    assert sum(mb.input_ids.numel() for mb in mbs) < sum(s.num_tokens for s in seqs) <= sum(
        mb.input_ids.numel() for mb in mbp)


@pytest.mark.parametrize("cfg", [
    {},  # one update: old logprobs are the detached current ones
    {"optimizer_steps": 2, "pack_max_length": 64},  # an old-logprob pass, mini-batches, several packs
    {"kl": {"coef": 0.1}, "rollout_is": {"threshold_upper": 2.0}},  # reference model and rollout IS
    {"gradient_checkpointing": True},
])
def test_shared_training_gives_the_same_updates(model_dir, cfg):  # noqa: F811
    seqs = grouped_batch(seed=4)
    a, b = make_worker(model_dir, **cfg), make_worker(model_dir, share_prompts=True, **cfg)
    for step in range(2):
        ma, mb = a.train_step(seqs), b.train_step(seqs)
        for k in ("train/loss", "train/grad_norm", "train/entropy", "train/tokens"):
            assert ma[k] == pytest.approx(mb[k], rel=1e-4, abs=1e-6), (step, k)
    assert_close_weights(a, b)


def assert_close_weights(a, b):
    """Adam turns float noise in near-zero gradients into weight noise of up to ~lr / 100 per step
    (lr 1e-2 here; the gradients themselves are compared in test_shared_gradients_equal_the_unshared),
    while a wrong token or label moves weights by ~lr."""
    sa, sb = state(a), state(b)
    for k in sa:
        assert torch.allclose(sa[k], sb[k], atol=1e-3, rtol=0), k


def _grads(worker, seqs):
    (mbs,) = worker._micro_batches(seqs, [list(range(len(seqs)))])
    for mb in mbs:
        logp, ent = worker._forward(mb)
        (logp * mb.advantages).sum().backward()
    out = {n: p.grad.full_tensor().clone() for n, p in worker.model.named_parameters() if p.grad is not None}
    worker.optimizer.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("fixture", ["model_dir", "untied_dir"])
def test_shared_gradients_equal_the_unshared(fixture, request):
    path = request.getfixturevalue(fixture)
    seqs = grouped_batch(seed=7)
    ga = _grads(make_worker(path), seqs)
    gb = _grads(make_worker(path, share_prompts=True, pack_max_length=48), seqs)  # several packs, split groups
    assert set(ga) == set(gb)
    for k in ga:
        scale = ga[k].abs().max().item()
        assert scale > 0, k
        assert torch.allclose(ga[k], gb[k], atol=1e-5 * scale, rtol=1e-4), k


def test_shared_layout_under_compiled_layers(model_dir):  # noqa: F811
    """The attention rows reach the attention function inside torch.compile'd decoder layers (with
    recomputation), through two steps of different shapes, and the update is the eager one's."""
    seqs = grouped_batch(groups=4, seed=5)
    other = grouped_batch(groups=3, size=5, seed=6)
    eager = make_worker(model_dir, share_prompts=True)
    comp = make_worker(model_dir, share_prompts=True,
                       fsdp={"torch_compile": True, "activation_memory_budget": 0.0})
    for batch in (seqs, other):
        ma, mb = eager.train_step(batch), comp.train_step(batch)
        assert ma["train/grad_norm"] == pytest.approx(mb["train/grad_norm"], rel=1e-4)
    assert_close_weights(eager, comp)


@pytest.mark.gpu
def test_shared_layout_on_cuda(model_dir):  # noqa: F811
    """bf16, compiled layers with recomputation, the GPU's attention kernels: logprobs and a training
    step agree with the ordinary layout's within bf16 noise."""
    from rlcli.config import ModelConfig
    from rlcli.algo.loss import VanillaPolicyLoss
    from rlcli.train.worker import TrainWorker

    seqs = grouped_batch(groups=8, size=8, seed=8)

    def worker(**cfg):
        return TrainWorker(model_dir, ModelConfig(), TrainWorkerConfig(
            optimizer={"lr": 1e-3}, fsdp={"torch_compile": True, "activation_memory_budget": 0.0}, **cfg),
            VanillaPolicyLoss(), device="cuda", dtype=torch.bfloat16, seed=0, total_steps=10)

    plain, shared = worker(), worker(share_prompts=True)
    a, b = plain.compute_logprobs(seqs), shared.compute_logprobs(seqs)
    diff = max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))
    assert diff < 0.05, diff
    ma, mb = plain.train_step(seqs), shared.train_step(seqs)
    assert ma["train/grad_norm"] == pytest.approx(mb["train/grad_norm"], rel=0.05)
    assert ma["train/tokens"] == mb["train/tokens"]
