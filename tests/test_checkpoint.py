"""Checkpoints: exact resume, atomic saves, crash leftovers, latest/prune, weights-only loads."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from rlcli.algo.loss import VanillaPolicyLoss
from rlcli.config import ModelConfig, TrainWorkerConfig
from rlcli.models import tiny_model_dir
from rlcli.train import checkpoint as ckpt
from rlcli.train.data import TrainSequence
from rlcli.train.worker import TrainWorker

CFG = {"optimizer": {"lr": 5e-3, "weight_decay": 0.01}, "optimizer_steps": 2,
       "lr_scheduler": {"name": "cosine", "warmup_steps": 3, "min_lr_ratio": 0.1}, "pack_max_length": 32}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("ckpt-model") / "m", arch="qwen2", seed=3)


def make_worker(model_dir, **over) -> TrainWorker:
    return TrainWorker(model_dir, ModelConfig(), TrainWorkerConfig(**{**CFG, **over}), VanillaPolicyLoss(),
                       device="cpu", seed=0, total_steps=6)


def batch(step: int) -> list[TrainSequence]:
    rng = random.Random(100 + step)
    out = []
    for i in range(24):
        resp = [rng.randrange(4, 53) for _ in range(rng.randint(1, 4))]
        out.append(TrainSequence([rng.randrange(4, 53) for _ in range(rng.randint(2, 6))], resp, [1] * len(resp),
                                 [-3.0] * len(resp), rng.uniform(-1, 1), 1.0, i))
    return out


def weights(w: TrainWorker) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in w.full_state_dict().items()}


def run(w: TrainWorker, steps) -> list[dict[str, float]]:
    return [{k: v for k, v in w.train_step(batch(s)).items() if k != "train/step_time_s"} for s in steps]


def test_exact_resume(model_dir, tmp_path):
    a = make_worker(model_dir)
    run(a, [1, 2])
    extra = {"step": 2, "sampler": {"epoch": 1, "pos": [3, 4]}, "buffer": [{"ids": [1, 2]}], "t": torch.arange(3)}
    path = a.save_checkpoint(ckpt.step_dir(tmp_path, 2), extra)
    rng_after_save = (random.random(), np.random.rand(), torch.rand(2))
    expected = run(a, [3, 4])
    expected_w = weights(a)

    b = make_worker(model_dir)
    random.seed(999), np.random.seed(999), torch.manual_seed(999)
    got_extra = b.load_checkpoint(path)
    assert (random.random(), np.random.rand()) == rng_after_save[:2] and torch.equal(torch.rand(2), rng_after_save[2])
    assert got_extra["sampler"] == extra["sampler"] and got_extra["buffer"] == extra["buffer"]
    assert torch.equal(got_extra["t"], extra["t"]) and got_extra["step"] == 2
    assert b.optimizer_steps_done == 4
    got = run(b, [3, 4])
    assert got == expected  # bit-identical losses, grad norms, LRs, every metric
    got_w = weights(b)
    assert all(torch.equal(got_w[k], expected_w[k]) for k in expected_w)


def test_checkpoint_layout_and_latest(model_dir, tmp_path):
    w = make_worker(model_dir)
    run(w, [1])
    for step in (1, 3, 2):
        w.save_checkpoint(ckpt.step_dir(tmp_path, step), {"step": step})
    p = ckpt.step_dir(tmp_path, 3)
    assert {x.name for x in p.iterdir()} == {"weights", "rank-0.pt", "extra_state.pt", "meta.json", ckpt.COMPLETE}
    assert json.loads((p / "meta.json").read_text()) == {"format": 1, "world_size": 1, "has_optimizer": True}
    assert ckpt.latest_checkpoint(tmp_path) == p
    (tmp_path / "step-10").mkdir()  # no COMPLETE marker: not a checkpoint
    (tmp_path / "step-11.tmp").mkdir()
    (tmp_path / "notes").mkdir()
    assert ckpt.latest_checkpoint(tmp_path) == p
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1, 2, 3]
    assert ckpt.latest_checkpoint(tmp_path / "missing") is None

    assert ckpt.prune(tmp_path, -1) == [] and ckpt.prune(tmp_path, None) == []
    removed = ckpt.prune(tmp_path, 2)
    assert removed == [ckpt.step_dir(tmp_path, 1)]
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3]


def test_crash_mid_save_keeps_previous_checkpoint(model_dir, tmp_path, monkeypatch):
    w = make_worker(model_dir)
    run(w, [1])
    good = w.save_checkpoint(ckpt.step_dir(tmp_path, 1), {"step": 1})
    before = weights(w)
    run(w, [2])

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(ckpt.dcp, "save", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        w.save_checkpoint(ckpt.step_dir(tmp_path, 2), {"step": 2})
    monkeypatch.undo()
    assert (tmp_path / "step-2.tmp").is_dir() and not (tmp_path / "step-2").exists()
    assert ckpt.latest_checkpoint(tmp_path) == good  # the leftover is ignored

    fresh = make_worker(model_dir)
    assert fresh.load_checkpoint(ckpt.latest_checkpoint(tmp_path)) == {"step": 1}
    after = weights(fresh)
    assert all(torch.equal(before[k], after[k]) for k in before)

    w.save_checkpoint(ckpt.step_dir(tmp_path, 3), {"step": 3})  # the next save cleans the leftover
    assert not (tmp_path / "step-2.tmp").exists()
    assert ckpt.latest_checkpoint(tmp_path) == ckpt.step_dir(tmp_path, 3)


def test_overwrite_and_interrupted_replace(model_dir, tmp_path):
    w = make_worker(model_dir)
    run(w, [1])
    p = w.save_checkpoint(ckpt.step_dir(tmp_path, 5), {"v": 1})
    w.save_checkpoint(p, {"v": 2})
    assert make_worker(model_dir).load_checkpoint(p) == {"v": 2}
    assert sorted(x.name for x in tmp_path.iterdir()) == ["step-5"]
    # a crash between moving the old copy aside and renaming the new one: the old copy comes back
    p.rename(tmp_path / "step-5.old")
    (tmp_path / "step-5.tmp").mkdir()
    assert ckpt.latest_checkpoint(tmp_path) is None
    ckpt.clean_incomplete(tmp_path)
    assert ckpt.latest_checkpoint(tmp_path) == p and not (tmp_path / "step-5.tmp").exists()
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        w.load_checkpoint(tmp_path / "step-9")


def test_no_optimizer_and_weights_only(model_dir, tmp_path):
    a = make_worker(model_dir)
    run(a, [1, 2])
    path = a.save_checkpoint(ckpt.step_dir(tmp_path, 2), {"step": 2}, no_optimizer=True)
    assert json.loads((path / "meta.json").read_text())["has_optimizer"] is False
    saved = weights(a)
    lr = a.optimizer.param_groups[0]["lr"]

    b = make_worker(model_dir)
    b.load_checkpoint(path)
    assert all(torch.equal(saved[k], v) for k, v in weights(b).items())
    assert not b.optimizer.state  # fresh optimizer
    assert b.optimizer_steps_done == 4 and b.optimizer.param_groups[0]["lr"] == pytest.approx(lr)

    c = make_worker(model_dir)
    with_optim = a.save_checkpoint(ckpt.step_dir(tmp_path, 3), {"step": 3})
    state = torch.get_rng_state()
    assert c.load_checkpoint(with_optim, weights_only=True) == {"step": 3}
    assert all(torch.equal(saved[k], v) for k, v in weights(c).items())
    assert not c.optimizer.state and c.optimizer_steps_done == 0
    assert torch.equal(torch.get_rng_state(), state)  # RNG untouched


def test_rng_state_round_trip():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = ckpt.capture_rng_state()
    first = (random.random(), float(np.random.rand()), torch.rand(3))
    ckpt.restore_rng_state(state)
    again = (random.random(), float(np.random.rand()), torch.rand(3))
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])
