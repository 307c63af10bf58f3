"""Rollout/training mismatch correction (TIS / MIS / veto) against hand-written references (XTuner acceptance 49).

End-to-end behaviour inside ``TrainWorker.train_step`` is in test_train_worker.py.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from pydantic import ValidationError

from rlcli.algo.mismatch import ESS_SQ_KEY, can_reject, finalize_metrics, rollout_correction
from rlcli.config import RolloutISConfig, TrainWorkerConfig


def _run(seqs: list[list[tuple[float, float | None]]], **cfg):
    """``seqs``: per sequence, ``(old_logp, rollout_logp or None)`` per token."""
    old, rollout, valid, ids = [], [], [], []
    for i, toks in enumerate(seqs):
        for o, r in toks:
            old.append(o)
            rollout.append(0.0 if r is None else r)
            valid.append(r is not None)
            ids.append(i)
    c = rollout_correction(torch.tensor(old), torch.tensor(rollout), torch.tensor(valid, dtype=torch.bool),
                           torch.tensor(ids, dtype=torch.long), len(seqs), RolloutISConfig(**cfg))
    metrics = {k: (s / n).item() if n > 0 else 0.0 for k, (s, n) in c.sums.items()}
    metrics.update({k: v.item() for k, v in {**c.maxes, **c.mins}.items()})
    return c, finalize_metrics(metrics)


def _ratios(*rs: float) -> list[tuple[float, float]]:
    """Tokens whose training/rollout ratio is ``r`` (old = log r - 1, rollout = -1)."""
    return [(math.log(r) - 1.0, -1.0) for r in rs]


# ------------------------------------------------------------------------------ acceptance 49
def test_acceptance_49_truncate():
    c, _ = _run([_ratios(3.0, 0.25, 1.5, 1.0)], threshold_upper=2.0, threshold_lower=0.5, mode="truncate")
    assert c.weight.tolist() == pytest.approx([2.0, 0.5, 1.5, 1.0], abs=1e-6)
    assert c.keep is None  # truncation never drops a token


def test_acceptance_49_mask():
    c, m = _run([_ratios(3.0, 0.25, 1.5, 1.0)], threshold_upper=2.0, threshold_lower=0.5, mode="mask")
    assert c.keep.tolist() == [False, False, True, True]  # ratio 3 (and 0.25) get label -100
    assert c.weight[2:].tolist() == pytest.approx([1.5, 1.0], abs=1e-6)  # the rest keep their IS weight
    assert m["mismatch/masked_frac"] == pytest.approx(0.5)
    c, _ = _run([_ratios(3.0, 0.25, 1.5, 1.0)], threshold_upper=2.0, threshold_lower=0.5, mode="both")
    assert c.keep.tolist() == [False, False, True, True]
    c, _ = _run([_ratios(3.0, 1.9, 0.3)], threshold_upper=1.5, threshold_lower=0.5, mask_upper=2.0,
                mask_lower=0.25, mode="both")
    assert c.keep.tolist() == [False, True, True]
    assert c.weight[1:].tolist() == pytest.approx([1.5, 0.5], abs=1e-6)  # masked by one band, truncated by the other


@pytest.mark.parametrize("mode", ["truncate", "mask", "both"])
def test_acceptance_49_veto_drops_whole_sequences(mode):
    seqs = [_ratios(1.0, 50.0, 1.0), _ratios(1.2, 0.9), _ratios(1.0, 1e-4), _ratios(0.02, 19.0)]
    c, m = _run(seqs, mode=mode, veto_upper=20.0, veto_lower=1e-3)
    assert c.keep.tolist() == [False] * 3 + [True] * 2 + [False] * 2 + [True] * 2
    assert m["mismatch/veto_frac"] == pytest.approx(0.5)
    assert m["mismatch/masked_frac"] == pytest.approx(5 / 9)
    assert c.weight is None  # no threshold: a veto alone does not weight
    # XTuner's example band (20, 0): lower 0 means no lower veto
    c, _ = _run(seqs, veto_upper=20.0, veto_lower=0.0)
    assert c.keep.tolist() == [False] * 3 + [True] * 6


def test_acceptance_49_threshold_none_reports_metrics_only():
    seqs = [_ratios(3.0, 0.5), [(-0.5, -0.7)]]
    c, m = _run(seqs)
    assert c.weight is None and c.keep is None  # no weights, nothing dropped
    assert not can_reject(RolloutISConfig())
    deltas = [math.log(3.0), math.log(0.5), 0.2]
    assert m["mismatch/kl"] == pytest.approx(sum(-d for d in deltas) / 3, abs=1e-6)
    assert m["mismatch/is_max"] == pytest.approx(3.0, abs=1e-5) and m["mismatch/is_min"] == pytest.approx(0.5)
    assert m["mismatch/masked_frac"] == 0.0 and m["mismatch/veto_frac"] == 0.0


# ---------------------------------------------------------------------- reference formulas
def _reference(seqs, level, mode, t_lo=None, t_hi=None, m_lo=None, m_hi=None, v_lo=None, v_hi=None):
    """XTuner §8.7, written out over Python lists: (weights, keep) per token of valid sequences."""
    m_lo = t_lo if m_lo is None else m_lo
    m_hi = t_hi if m_hi is None else m_hi
    weights, keep = [], []
    for toks in seqs:
        deltas = [o - r for o, r in toks]
        if level == "token":
            xs = deltas
        elif level == "sequence":
            xs = [sum(deltas)] * len(deltas)
        else:
            xs = [sum(deltas) / len(deltas)] * len(deltas)
        raw = [math.exp(min(max(x, -20.0), 20.0)) for x in xs]
        veto = any((v_lo is not None and v_lo > 0 and d < math.log(v_lo)) or (v_hi is not None and d > math.log(v_hi))
                   for d in deltas)
        for w in raw:
            masked = mode in ("mask", "both") and ((m_lo is not None and w < m_lo) or (m_hi is not None and w > m_hi))
            keep.append(not (masked or veto))
            if mode in ("truncate", "both"):
                w = min(max(w, t_lo if t_lo is not None else -math.inf), t_hi if t_hi is not None else math.inf)
            weights.append(w)
    return weights, keep


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask", "both"])
def test_weights_and_masks_match_reference(level, mode):
    rng = random.Random(f"{level}-{mode}")
    for _ in range(5):
        seqs = []
        for _ in range(rng.randint(1, 6)):
            n = rng.randint(1, 5)
            seqs.append([(rng.uniform(-4, 0), rng.uniform(-4, 0)) for _ in range(n)])
        bands = dict(t_lo=0.5, t_hi=2.0, m_lo=0.2, m_hi=5.0, v_lo=0.02, v_hi=50.0)
        c, _ = _run(seqs, level=level, mode=mode, threshold_lower=0.5, threshold_upper=2.0, mask_lower=0.2,
                    mask_upper=5.0, veto_lower=0.02, veto_upper=50.0)
        w_ref, keep_ref = _reference(seqs, level, mode, **bands)
        assert c.keep.tolist() == keep_ref
        got = [w for w, k in zip(c.weight.tolist(), keep_ref) if k]
        assert got == pytest.approx([w for w, k in zip(w_ref, keep_ref) if k], rel=1e-5)


def test_one_sided_bands():
    # the original TIS: clamp above only
    c, _ = _run([_ratios(5.0, 0.01)], threshold_upper=2.0)
    assert c.weight.tolist() == pytest.approx([2.0, 0.01], abs=1e-6)
    c, _ = _run([_ratios(5.0, 0.01)], threshold_lower=0.1, mode="mask")
    assert c.keep.tolist() == [True, False] and c.weight[0].item() == pytest.approx(5.0, rel=1e-5)


def test_metrics_match_reference():
    rng = random.Random(3)
    seqs = [[(rng.uniform(-3, 0), rng.uniform(-3, 0)) for _ in range(rng.randint(1, 6))] for _ in range(7)]
    seqs.append([(-1.0, None), (-2.0, None)])  # no rollout logprobs: ignored by every metric
    c, m = _run(seqs, level="token", mode="both", threshold_upper=1.5, threshold_lower=0.8, mask_upper=3.0,
                mask_lower=0.3)
    toks = [(o, r) for s in seqs for o, r in s if r is not None]
    d = [o - r for o, r in toks]
    n = len(d)
    w = [math.exp(x) for x in d]
    assert m["mismatch/kl"] == pytest.approx(sum(-x for x in d) / n, abs=1e-6)
    assert m["mismatch/k3_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / n, abs=1e-6)
    assert m["mismatch/logprob_abs_diff"] == pytest.approx(sum(abs(x) for x in d) / n, abs=1e-6)
    assert m["mismatch/is_mean"] == pytest.approx(sum(w) / n, abs=1e-6)
    assert m["mismatch/is_max"] == pytest.approx(max(w), abs=1e-5)
    assert m["mismatch/is_min"] == pytest.approx(min(w), abs=1e-6)
    assert m["mismatch/ess"] == pytest.approx((sum(w) / n) ** 2 / (sum(x * x for x in w) / n), abs=1e-6)
    assert 0 < m["mismatch/ess"] <= 1 and ESS_SQ_KEY not in m
    masked = [x < 0.3 or x > 3.0 for x in w]
    assert m["mismatch/masked_frac"] == pytest.approx(sum(masked) / n)
    trunc = [not mk and (x < 0.8 or x > 1.5) for x, mk in zip(w, masked)]
    assert m["mismatch/truncated_frac"] == pytest.approx(sum(trunc) / n)
    # per sequence: log ppl(training) - log ppl(rollout) = mean(rollout) - mean(old)
    per_seq = [(sum(o for o, _ in s) / len(s), sum(r for _, r in s) / len(s)) for s in seqs[:-1]]
    diffs = [mr - mo for mo, mr in per_seq]
    assert m["mismatch/log_ppl_diff"] == pytest.approx(sum(diffs) / 7, abs=1e-6)
    assert m["mismatch/log_ppl_abs_diff"] == pytest.approx(sum(abs(x) for x in diffs) / 7, abs=1e-6)
    assert m["mismatch/log_ppl_diff_max"] == pytest.approx(max(diffs), abs=1e-6)
    assert m["mismatch/log_ppl_diff_min"] == pytest.approx(min(diffs), abs=1e-6)
    assert m["mismatch/ppl_ratio"] == pytest.approx(sum(math.exp(x) for x in diffs) / 7, abs=1e-6)
    assert m["mismatch/training_ppl"] == pytest.approx(sum(math.exp(-mo) for mo, _ in per_seq) / 7, rel=1e-6)
    assert m["mismatch/rollout_ppl"] == pytest.approx(sum(math.exp(-mr) for _, mr in per_seq) / 7, rel=1e-6)
    # the tokens without rollout logprobs are untouched
    assert c.keep[-2:].tolist() == [True, True] and c.weight[-2:].tolist() == [1.0, 1.0]


def test_log_ratio_is_clamped_and_nan_is_dropped():
    c, m = _run([[(0.0, -30.0), (-30.0, 0.0)]], threshold_upper=2.0)
    assert m["mismatch/is_max"] == pytest.approx(math.exp(20.0), rel=1e-6)
    assert m["mismatch/is_min"] == pytest.approx(math.exp(-20.0), rel=1e-6)
    assert torch.isfinite(c.weight).all()
    c, _ = _run([[(-1.0, float("nan")), (-1.0, -1.0)]], threshold_upper=2.0, threshold_lower=0.5, mode="mask")
    assert c.keep.tolist() == [False, True]  # a NaN weight is outside every band


def test_empty_batch():
    c, m = _run([], threshold_upper=2.0, mode="mask")
    assert c.keep.numel() == 0 and c.weight.numel() == 0
    assert m["mismatch/kl"] == 0.0 and m["mismatch/ess"] == 0.0
    assert m["mismatch/is_max"] == -math.inf  # the worker reports non-finite extremes as 0


# -------------------------------------------------------------------------------- config
def test_config_bands_and_validation():
    assert TrainWorkerConfig().rollout_is is None
    cfg = RolloutISConfig(threshold_upper=2.0, threshold_lower=0.5)
    assert cfg.bands() == {"threshold": (0.5, 2.0), "mask": (0.5, 2.0), "veto": (None, None)}
    assert not can_reject(cfg) and can_reject(cfg.model_copy(update={"mode": "both"}))
    assert can_reject(RolloutISConfig(veto_upper=10.0)) and not can_reject(RolloutISConfig(veto_lower=0.0))
    assert not can_reject(None)
    # XTuner's tuples are (upper, lower); here the bounds are named and an inverted band names both fields
    with pytest.raises(ValidationError, match=r"threshold_upper=0.8 must be greater than threshold_lower=1.2"):
        RolloutISConfig(threshold_upper=0.8, threshold_lower=1.2)
    with pytest.raises(ValidationError, match=r"veto_upper=1.0 must be greater than veto_lower=1.0"):
        RolloutISConfig(veto_upper=1.0, veto_lower=1.0)
    # a mask bound falls back to the threshold's: the message names the fields actually in play
    with pytest.raises(ValidationError, match=r"mask_upper=0.4 must be greater than threshold_lower=0.5"):
        RolloutISConfig(threshold_upper=2.0, threshold_lower=0.5, mask_upper=0.4, mode="mask")
    with pytest.raises(ValidationError, match="rollout_is"):
        TrainWorkerConfig(rollout_is={"threshold_upper": 0.5, "threshold_lower": 2.0})
    for bad in ({"threshold_upper": 0.0}, {"threshold_lower": -1.0}, {"level": "seq"}, {"mode": "clip"},
                {"rollout_is_threshold": 2.0}):
        with pytest.raises(ValidationError):
            RolloutISConfig(**bad)
