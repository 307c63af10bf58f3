"""Training-sequence construction, packing, layouts and chunked log-probs (XTuner acceptance 39, 40, 42)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from rlcli.models import tiny_model_dir
from rlcli.train.data import (
    IGNORE_INDEX,
    LayoutCost,
    Pack,
    TrainSequence,
    build_micro_batch,
    choose_layout,
    empty_micro_batch,
    pack_balanced,
    pack_sequences,
    split_minibatches,
)
from rlcli.train.logprobs import PolicyModel, chunked_logprobs


def seq(prompt, response, mask=None, logprobs=None, adv=1.0, temperature=1.0, seq_id=0) -> TrainSequence:
    mask = [1] * len(response) if mask is None else mask
    return TrainSequence(prompt, response, mask, logprobs, adv, temperature, seq_id)


# ------------------------------------------------------------------------- construction
def test_acceptance_39_layout():
    s = seq([10, 11, 12], [20, 21, 22], mask=[1, 0, 1], logprobs=[0.1, 0.2, 0.3], adv=2.5)
    input_ids, labels, adv, logp = s.build()
    assert input_ids == [10, 11, 12, 20, 21]
    assert labels == [-100, -100, 20, -100, 22]
    # XTuner keeps the masked token's logprob ([0, 0, .1, .2, .3]); rlcli zeroes every masked position
    assert logp == [0.0, 0.0, 0.1, 0.0, 0.3]
    assert adv == [0.0, 0.0, 2.5, 0.0, 2.5]
    assert s.num_tokens == 5 and s.num_valid == 2
    assert len(input_ids) == len(labels) == len(adv) == len(logp)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_micro_batch_gathers_exactly_the_label_positions(layout):
    a = seq([10, 11, 12], [20, 21, 22], mask=[1, 0, 1], logprobs=[0.1, 0.2, 0.3], adv=2.5, temperature=0.5)
    b = seq([30], [40, 41], logprobs=None, adv=-1.0)
    c = seq([50, 51], [60], mask=[0], logprobs=[0.9])
    seqs = [a, b, c]
    mb = build_micro_batch(seqs, Pack([0, 1, 2], [s.num_tokens for s in seqs]), layout)
    flat_ids = mb.input_ids.reshape(-1)
    flat_pos = mb.position_ids.reshape(-1)
    got = []
    for s in seqs:
        ids, labels, adv, logp = s.build()
        got += [(lab, a_, lp) for lab, a_, lp in zip(labels, adv, logp) if lab != IGNORE_INDEX]
    assert mb.labels.tolist() == [g[0] for g in got] == [20, 22, 40, 41]
    assert mb.advantages.tolist() == [g[1] for g in got]
    assert mb.rollout_logprobs.tolist() == pytest.approx([g[2] for g in got])
    assert mb.has_rollout_logprobs.tolist() == [True, True, False, False]
    assert mb.inv_temperature.tolist() == [2.0, 2.0, 1.0, 1.0]
    assert mb.seq_index.tolist() == [0, 0, 1, 1]
    assert mb.label_counts == [2, 2, 0] and mb.seq_indices == [0, 1, 2]
    # the token at each label position is the one *before* the label in the sequence
    assert flat_ids[mb.label_index].tolist() == [12, 21, 30, 40]
    assert flat_pos[mb.label_index].tolist() == [2, 4, 0, 1]
    if layout == "packed":
        assert mb.input_ids.tolist() == [[10, 11, 12, 20, 21, 30, 40, 50, 51]]
        assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1]]
    else:
        assert mb.input_ids.tolist() == [[10, 11, 12, 20, 21], [30, 40, 0, 0, 0], [50, 51, 0, 0, 0]]
        assert mb.position_ids.tolist() == [list(range(5))] * 3


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_micro_batch_matches_per_sequence_build_on_random_packs(layout):
    rng = random.Random(3)
    seqs = []
    for i in range(40):
        n = rng.randint(1, 9)
        mask = [1] * n if rng.random() < 0.6 else [rng.randint(0, 1) for _ in range(n)]
        lps = [rng.uniform(-5, 0) for _ in range(n)] if rng.random() < 0.8 else None
        seqs.append(seq([rng.randrange(100) for _ in range(rng.randint(1, 6))], [rng.randrange(100) for _ in range(n)],
                        mask=mask, logprobs=lps, adv=rng.uniform(-2, 2), temperature=rng.choice([1.0, 0.7]), seq_id=i))
    for pack in pack_sequences(seqs, 60):
        mb = build_micro_batch(seqs, pack, layout, pad_id=7)
        flat_ids = mb.input_ids.reshape(-1)
        want_ids, labels, adv, logp, owner, before = [], [], [], [], [], []
        for i in pack.indices:
            ids, lab, a, lp = seqs[i].build()
            want_ids.append(ids)
            kept = [k for k, x in enumerate(lab) if x != IGNORE_INDEX]
            before += [ids[k] for k in kept]  # the input token at each label's position
            labels += [lab[k] for k in kept]
            adv += [a[k] for k in kept]
            logp += [lp[k] for k in kept]
            owner += [i] * len(kept)
        assert mb.labels.tolist() == labels and mb.seq_index.tolist() == owner
        assert mb.advantages.tolist() == pytest.approx(adv) and mb.rollout_logprobs.tolist() == pytest.approx(logp)
        if layout == "packed":
            assert flat_ids.tolist() == [t for ids in want_ids for t in ids]
        else:
            width = max(len(x) for x in want_ids)
            assert mb.input_ids.tolist() == [x + [7] * (width - len(x)) for x in want_ids]
        assert flat_ids[mb.label_index].tolist() == before
        assert mb.label_counts == [seqs[i].num_valid for i in pack.indices]


def test_acceptance_40_each_sample_keeps_its_advantage():
    group = [seq([1, 2], [3, 4], adv=1.5), seq([1, 2], [5], adv=-2.0)]
    (pack,) = pack_sequences(group, 100)
    mb = build_micro_batch(group, pack, "packed")
    assert mb.advantages.tolist() == [1.5, 1.5, -2.0]


def test_sequence_validation_acceptance_42():
    with pytest.raises(ValueError, match="response_mask has 2 entries, response_ids 3"):
        seq([1], [2, 3, 4], mask=[1, 1])
    with pytest.raises(ValueError, match="rollout_logprobs has 1 entries"):
        seq([1], [2, 3], logprobs=[0.1])
    with pytest.raises(ValueError, match="response_ids is empty"):
        seq([1], [])
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        seq([], [1])
    with pytest.raises(ValueError, match="temperature"):
        seq([1], [2], temperature=-1.0)
    assert seq([1], [2], temperature=0.0).effective_temperature == 1.0


def test_empty_micro_batch_has_no_labels():
    mb = empty_micro_batch()
    assert mb.num_labels == 0 and mb.input_ids.shape == (1, 1)


# ------------------------------------------------------------------------------ packing
def test_first_fit_packing():
    seqs = [seq([1] * n, [2]) for n in (6, 5, 2, 3)]  # n input tokens each
    packs = pack_sequences(seqs, 8)
    assert [p.indices for p in packs] == [[0, 2], [1, 3]]  # sequential fill would need 3 packs
    assert [p.num_tokens for p in packs] == [8, 8]
    assert [p.indices for p in pack_sequences(seqs, 8, indices=[3, 1])] == [[3, 1]]
    assert all(p.num_tokens <= 8 for p in pack_sequences(seqs * 7, 8))


def test_too_long_sequence_names_both_lengths():
    with pytest.raises(ValueError, match=r"9 input tokens.*pack_max_length=8"):
        pack_sequences([seq([1] * 5, [2] * 5)], 8)


def test_split_minibatches_balanced_contiguous_deterministic():
    counts = [5, 1, 1, 1, 1, 1, 5, 5]
    parts = split_minibatches(counts, 2)
    assert parts == [[0, 1, 2, 3, 4, 5], [6, 7]]  # 10 vs 10 tokens
    assert split_minibatches(counts, 3) == [[0, 1, 2], [3, 4, 5, 6], [7]]  # 7 / 8 / 5 tokens
    assert [i for p in parts for i in p] == list(range(len(counts)))
    assert split_minibatches(counts, 2) == parts
    rng = random.Random(0)
    for _ in range(50):
        c = [rng.randint(1, 20) for _ in range(rng.randint(1, 40))]
        k = rng.randint(1, 6)
        parts = split_minibatches(c, k)
        assert len(parts) == k and [i for p in parts for i in p] == list(range(len(c)))
        if len(c) >= k:
            assert all(parts)
            sizes = [sum(c[i] for i in p) for p in parts]
            assert max(sizes) - min(sizes) <= 2 * max(c) + sum(c) / k  # no badly lopsided split
    assert split_minibatches([3, 4], 4) == [[0], [1], [], []]


def test_choose_layout():
    cost = LayoutCost(per_token=2 * (64 * 16 * 12 + 3 * 64 * 128), per_pair=4 * 64)
    assert choose_layout([4] * 800, 8192, cost) == "padded"
    assert choose_layout([4] * 800, 1000, cost) == "packed"  # 3200 padded tokens exceed the limit
    assert choose_layout([11] + [9] * 1023, 8192, cost) == "padded"  # 11264 padded: dense packing would cost T^2
    assert choose_layout([11] + [9] * 1023, 8192, LayoutCost(cost.per_token, cost.per_pair, varlen=True)) == "packed"
    assert choose_layout([2000] + [3] * 100, 8192, cost) == "packed"  # padding would be 50x the tokens
    assert choose_layout([4] * 800, 8192, LayoutCost(cost.per_token, cost.per_pair, varlen=True)) == "packed"
    assert choose_layout([7], 8192, cost) == "packed"


# ------------------------------------------------------------------- model equivalence
@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    d = tiny_model_dir(tmp_path_factory.mktemp("tiny") / "m", arch="qwen2", seed=1)
    return AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()


def _random_seqs(n: int, seed: int, vocab: int) -> list[TrainSequence]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        resp = [rng.randrange(4, vocab) for _ in range(rng.randint(1, 6))]
        mask = [int(rng.random() < 0.8) for _ in resp]
        out.append(TrainSequence([rng.randrange(4, vocab) for _ in range(rng.randint(1, 7))], resp, mask,
                                 None, 1.0, rng.choice([1.0, 0.7, 1.3]), i))
    return out


def _reference_logprobs(lm, seqs):
    """One plain HF forward per sequence: log_softmax(logits / T) at the masked-in response tokens."""
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s.prompt_ids + s.response_ids[:-1]])
            logits = lm(input_ids=ids, use_cache=False).logits[0].float() / s.effective_temperature
            lp = F.log_softmax(logits, -1)
            p = len(s.prompt_ids)
            out += [lp[p - 1 + j, r].item() for j, (r, m) in enumerate(zip(s.response_ids, s.response_mask)) if m]
    return torch.tensor(out)


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_packed_forward_equals_per_sequence_forwards(tiny_lm, layout):
    seqs = _random_seqs(12, seed=4, vocab=tiny_lm.config.vocab_size)
    ref = _reference_logprobs(tiny_lm, seqs)
    model = PolicyModel(tiny_lm, chunk_size=5)
    got = torch.full_like(ref, float("nan"))
    starts = torch.tensor([0] + [s.num_valid for s in seqs]).cumsum(0).tolist()
    packs = pack_sequences(seqs, 24)
    assert len(packs) > 1
    with torch.no_grad():
        for pack in packs:
            mb = build_micro_batch(seqs, pack, layout)
            logp, _ = model(mb.input_ids, mb.position_ids, mb.label_index, mb.labels, mb.inv_temperature)
            pos = 0
            for i, c in zip(mb.seq_indices, mb.label_counts):
                got[starts[i]:starts[i] + c] = logp[pos:pos + c]
                pos += c
    assert torch.allclose(got, ref, atol=1e-5, rtol=0)


def test_packing_without_position_restart_would_leak(tiny_lm):
    """Negative control: the equivalence above depends on the restarting position ids."""
    seqs = _random_seqs(6, seed=5, vocab=tiny_lm.config.vocab_size)
    ref = _reference_logprobs(tiny_lm, seqs)
    (pack,) = pack_sequences(seqs, 1000)
    mb = build_micro_batch(seqs, pack, "packed")
    model = PolicyModel(tiny_lm, chunk_size=64)
    with torch.no_grad():
        leaky = torch.arange(mb.input_ids.shape[1]).unsqueeze(0)
        logp, _ = model(mb.input_ids, leaky, mb.label_index, mb.labels, mb.inv_temperature)
    assert (logp - ref).abs().max() > 1e-3


# --------------------------------------------------------------------- chunked logprobs
def _naive(hidden, weight, bias, labels, inv_t):
    logits = (hidden @ weight.t() + (bias if bias is not None else 0)).float() * inv_t.unsqueeze(1)
    lp = F.log_softmax(logits, -1)
    ent = -(lp.exp() * lp).sum(-1)
    return lp.gather(1, labels.unsqueeze(1)).squeeze(1), ent


@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_logprobs_equal_unchunked_values_and_grads(with_bias):
    torch.manual_seed(0)
    n, h, v = 37, 16, 50
    dt = torch.float64
    hidden = torch.randn(n, h, dtype=dt)
    weight = torch.randn(v, h, dtype=dt) * 0.5
    bias = torch.randn(v, dtype=dt) if with_bias else None
    labels = torch.randint(0, v, (n,))
    inv_t = torch.rand(n) + 0.5
    g = torch.randn(n, dtype=torch.float32)

    def grads(fn):
        hs = hidden.clone().requires_grad_(True)
        ws = weight.clone().requires_grad_(True)
        bs = bias.clone().requires_grad_(True) if bias is not None else None
        lp, ent = fn(hs, ws, bs)
        (lp * g).sum().backward()
        return lp.detach(), ent.detach(), hs.grad, ws.grad, bs.grad if bs is not None else None

    ref = grads(lambda hs, ws, bs: _naive(hs, ws, bs, labels, inv_t))
    for chunk in (1, 6, 37, 1000):
        got = grads(lambda hs, ws, bs: chunked_logprobs(hs, ws, bs, labels, inv_t, chunk))
        assert got[0].dtype == torch.float32
        for a, b in zip(got, ref):
            if b is not None:
                assert torch.allclose(a.double(), b.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_logp", [True, False])
def test_chunked_entropy_gradient_equals_autograd(with_logp):
    """The entropy bonus (train_worker.entropy_coef) differentiates the chunked entropy: its
    gradient, alone or beside the logprobs', is the one autograd gives the unchunked softmax."""
    torch.manual_seed(1)
    n, h, v = 29, 8, 23
    hidden, weight, bias = torch.randn(n, h), torch.randn(v, h) * 0.7, torch.randn(v)
    labels, inv_t = torch.randint(0, v, (n,)), torch.rand(n) + 0.5
    g_lp, g_ent = torch.randn(n), torch.randn(n)

    def grads(fn):
        hs, ws, bs = (t.clone().double().requires_grad_(True) for t in (hidden, weight, bias))
        lp, ent = fn(hs, ws, bs)
        ((lp * g_lp).sum() * with_logp + (ent * g_ent).sum()).backward()
        return hs.grad, ws.grad, bs.grad

    ref = grads(lambda hs, ws, bs: _naive(hs, ws, bs, labels, inv_t))
    for chunk in (4, 1000):
        got = grads(lambda hs, ws, bs: chunked_logprobs(hs, ws, bs, labels, inv_t, chunk))
        for a, b in zip(got, ref):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_chunked_logprobs_unit_temperature_and_no_entropy():
    torch.manual_seed(2)
    hidden = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(17, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 17, (13,))
    a, ea = chunked_logprobs(hidden, weight, None, labels, None, 4, with_entropy=False)
    (a * torch.arange(13.0)).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    b, eb = chunked_logprobs(hidden, weight, None, labels, torch.ones(13), 5)
    (b * torch.arange(13.0)).sum().backward()
    assert ea.numel() == 0 and eb.shape == (13,)
    assert torch.allclose(a, b, atol=1e-6)
    assert torch.allclose(grads[0], hidden.grad, atol=1e-6) and torch.allclose(grads[1], weight.grad, atol=1e-6)


def test_chunked_logprobs_float32_and_empty():
    torch.manual_seed(1)
    hidden, weight = torch.randn(9, 8), torch.randn(11, 8)
    labels, inv_t = torch.randint(0, 11, (9,)), torch.ones(9)
    a, ea = chunked_logprobs(hidden, weight, None, labels, inv_t, 2)
    b, eb = _naive(hidden, weight, None, labels, inv_t)
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(ea, eb, atol=1e-5)
    assert not ea.requires_grad
    empty_h = torch.zeros(0, 8, requires_grad=True)
    lp, ent = chunked_logprobs(empty_h, weight, None, labels[:0], inv_t[:0], 4)
    assert lp.shape == (0,) and ent.shape == (0,)
    lp.sum().backward()
    assert empty_h.grad.shape == (0, 8)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_logprobs(hidden, weight, None, labels, inv_t, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("unit_temperature", [True, False])
def test_fused_chunked_logprobs_match_eager_on_cuda(unit_temperature):
    """The torch.compile'd chunk math (CUDA) gives the eager path's values and gradients."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(3)
    n, h, v = 700, 64, 5003
    hidden = (torch.randn(n, h, device="cuda") * 0.5).bfloat16()
    weight = (torch.randn(v, h, device="cuda") * 0.5).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda")
    inv_t = None if unit_temperature else torch.rand(n, device="cuda") + 0.5
    g = torch.randn(n, device="cuda")

    def run(fused: bool):
        hs, ws = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = chunked_logprobs(hs, ws, None, labels, inv_t, 256, fused=fused)
        (lp * g).sum().backward()
        return lp, ent, hs.grad.float(), ws.grad.float()

    for a, b in zip(run(True), run(False)):
        assert torch.allclose(a, b, atol=2e-3, rtol=2e-2), (a - b).abs().max()


def test_dlogits_eager_equals_the_compilable_form():
    from rlcli.train.logprobs import _dlogits, _dlogits_eager

    torch.manual_seed(4)
    logits = torch.randn(9, 31) * 2
    labels = torch.randint(0, 31, (9,))
    g, it = torch.randn(9), torch.rand(9) + 0.5
    lse = torch.logsumexp(logits * it[:, None], dim=-1)
    for inv_t in (None, it):
        l = lse if inv_t is not None else torch.logsumexp(logits, dim=-1)
        want = _dlogits(logits, l, labels, g, inv_t)
        got = _dlogits_eager(logits.clone(), l, labels, g, inv_t)
        assert torch.allclose(got, want, atol=1e-6)


def test_balanced_packs_keep_the_count_and_drop_the_runt():
    # the benchmark's batch: 512 sequences of 319 input tokens; first fit leaves a 2-sequence pack
    same = [seq([1] * 64, [2] * 256) for _ in range(512)]
    ff, bal = pack_sequences(same, 32768), pack_balanced(same, 32768)
    assert len(ff) == len(bal) == 6 and len(ff[-1].indices) == 2
    assert min(p.num_tokens for p in bal) >= 80 * 319 and max(p.num_tokens for p in bal) <= 32768
    rng = random.Random(5)
    mixed = [seq([1] * rng.randint(1, 40), [2] * rng.randint(1, 200)) for _ in range(300)]
    for limit in (250, 1000, 4096, 100_000):
        for indices in (None, list(range(0, 300, 3))):
            ff, bal = pack_sequences(mixed, limit, indices), pack_balanced(mixed, limit, indices)
            assert len(bal) == len(ff)
            assert sorted(i for p in bal for i in p.indices) == sorted(indices or range(300))
            assert all(p.num_tokens <= limit and p.indices == sorted(p.indices) for p in bal)
            spread = lambda ps: max(p.num_tokens for p in ps) - min(p.num_tokens for p in ps)  # noqa: E731
            assert spread(bal) <= spread(ff)
            assert [p.indices for p in pack_balanced(mixed, limit, indices)] == [p.indices for p in bal]


def test_row_dynamic_compilation_matches_eager_and_compiles_once():
    # the training logprob math as it is compiled on CUDA (here through the CPU backend)
    from torch._dynamo.utils import counters

    from rlcli.compiling import compile_rows_dynamic
    from rlcli.train.logprobs import _dlogits, _softmax_stats

    torch._dynamo.reset()
    counters.clear()
    stats, dlogits = compile_rows_dynamic(_softmax_stats), compile_rows_dynamic(_dlogits)
    g = torch.Generator().manual_seed(0)
    for rows in (16, 5, 11):  # varying row counts: one compilation each, no recompiles
        logits = torch.randn(rows, 97, generator=g).to(torch.bfloat16)
        labels = torch.randint(0, 97, (rows,), generator=g)
        inv_t = torch.rand(rows, generator=g) + 0.5
        want = _softmax_stats(logits, labels, inv_t, True)
        got = stats(logits, labels, inv_t, True)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))
        up = torch.randn(rows, generator=g)
        assert torch.allclose(dlogits(logits, want[0], labels, up, inv_t).float(),
                              _dlogits(logits, want[0], labels, up, inv_t).float(), atol=1e-2)
    assert counters["frames"]["ok"] == 2
    # only the rows are symbolic: another vocabulary size is a new specialisation (dynamic=True
    # would have served it with the first compilation, and its kernels divide by the symbol)
    logits = torch.randn(6, 50, generator=g).to(torch.bfloat16)
    stats(logits, torch.randint(0, 50, (6,), generator=g), torch.rand(6, generator=g) + 0.5, True)  # same kinds of arguments
    assert counters["frames"]["ok"] == 3


def test_lazy_list_builds_each_item_once_on_first_use():
    from rlcli.train.data import LazyList

    calls = []
    items = LazyList([lambda i=i: calls.append(i) or i * 10 for i in range(4)])
    assert len(items) == 4 and calls == []
    assert items[2] == 20 and items[-1] == 30 and calls == [2, 3]
    assert list(items) == [0, 10, 20, 30] and items[1:3] == [10, 20]
    assert calls == [2, 3, 0, 1]  # nothing built twice
    with pytest.raises(IndexError):
        items[4]
