"""Checkpoints written before the redesign of issue 27 still resume.

``tests/data/ckpt-v0/`` was written by the code at commit 4fc714f (see its README). For each
runner: the step-4 checkpoint of an 8-step run of its ``recipe.yaml`` (the async quickstart
shrunk to seconds: replay buffer entries, sampler positions, Adam moments, LR schedule and RNG
states all in it) and the metrics rows of steps 5-8 that 4fc714f logged when it resumed from
that checkpoint. The current code must load each checkpoint and continue its run: a colocated
run to the same rows and weights, a disaggregated one (whose producer counters depend on thread
timing) with the same metric names and without training a group again.

Tolerance: 4fc714f resuming its own checkpoint reproduced its uninterrupted run bit for bit (as
tests/test_resume.py checks for the current code), and on the CPUs of the sessions that made and
first ran this test the rows were equal within ``rel=1e-5``. Another CPU rounds float32 differently
(an AMX-capable Xeon, 2026-12-04, same torch build and thread count): the sampled tokens were the
same, the training metrics drifted by up to 1.5e-5 relative by step 8, and the engine-against-trainer
differences (``mismatch/*``, ``train/rollout_logprob_diff``: small differences of two logprobs,
where float noise is large relative to them) by up to 0.3 %. So floats are compared with
``rel=1e-4`` (those differences with ``rel=1e-2``), which anything a broken resume changes still
fails: one different sampled token moves ``reward/mean`` by 1/40 and the token counts by whole
tokens; a resume that drops the Adam moments changes ``train/entropy`` by ~4 % from the next step
on (tried by hand).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlcli.runner.records import is_wall_time

FIXTURES = Path(__file__).resolve().parent / "data" / "ckpt-v0"
FIXTURE = FIXTURES / "colocate"
DISAGG = FIXTURES / "disaggregated"
STEP, TOTAL = 4, 8
TOL = {"rel": 1e-4, "abs": 1e-7}
NOISY_TOL = {"rel": 1e-2, "abs": 1e-6}  # differences of the engine's and the trainer's logprobs


def tolerance(key: str) -> dict:
    return NOISY_TOL if key.startswith("mismatch/") or key == "train/rollout_logprob_diff" else TOL
# Metric names added since 4fc714f, each listed here (a renamed or dropped one still fails)
ADDED_METRICS = {"rollout/loss_excluded_samples", "agent_loop/errors", "eval/agent_loop/errors", "reward/std"}
ADDED_COUNTERS = ("judger/crashes", "judger/out_of_memory")  # also as eval/...


def added(key: str) -> bool:
    return key in ADDED_METRICS or key.removeprefix("eval/") in ADDED_COUNTERS


def stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not is_wall_time(k)}


def rows(path: Path) -> list[dict]:
    return [stable(json.loads(x)) for x in path.read_text().splitlines() if x.strip()]


def assert_rows_match(got: dict, want: dict) -> None:
    new = {k: got.pop(k) for k in list(got) if added(k) and k not in want}
    spread = new.pop("reward/std", None)  # a statistic, not a counter: within the logged range
    assert spread is None or 0 <= spread <= got["reward/max"] - got["reward/min"], spread
    assert set(ADDED_COUNTERS) <= set(new) and set(new.values()) <= {0}, new  # logged, and zero in this run
    assert got.keys() == want.keys(), (sorted(set(got) ^ set(want)))
    for k, v in want.items():
        if isinstance(v, float):
            assert got[k] == pytest.approx(v, **tolerance(k)), (got["step"], k, got[k], v)
        else:
            assert got[k] == v, (got["step"], k, got[k], v)


def assert_weights_match(tensors: dict[str, torch.Tensor], tag: str) -> None:
    want = json.loads((FIXTURE / "weights.json").read_text())[tag]
    for name, w in want.items():
        t = tensors[name].double()
        assert t.numel() == w["numel"], name
        # a signed sum cancels: its noise scales with the sum of absolute values (the module docstring's
        # other CPU moved the embedding's sum by 7e-4 of 0.45, its absolute sum by under 1e-4 relative);
        # one step of lr 1e-2 moves every weight by ~1e-2: a lost resume moves the sum by ~0.2 or more
        assert float(t.sum()) == pytest.approx(w["sum"], abs=3e-4 * w["abs_sum"] + 1e-5), (tag, name)
        assert float(t.abs().sum()) == pytest.approx(w["abs_sum"], rel=1e-4), (tag, name)


def recipe_copy(tmp_path: Path, fixture: Path = FIXTURE) -> Path:
    """The fixture's recipe with its data next to it, outside the repository."""
    d = tmp_path / "recipe"
    d.mkdir()
    shutil.copy(fixture / "recipe.yaml", d / "recipe.yaml")
    shutil.copy(FIXTURES / "arith.jsonl", d / "arith.jsonl")
    return d / "recipe.yaml"


def resume(tmp_path: Path, fixture: Path, *launch: str) -> Path:
    """``rlcli train`` (auto_resume) in a fresh work dir that holds only the fixture's checkpoint."""
    recipe = recipe_copy(tmp_path, fixture)
    work = tmp_path / "work"
    shutil.copytree(fixture / "checkpoints" / f"step-{STEP}", work / "checkpoints" / f"step-{STEP}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, "-m", "rlcli.cli", "train", str(recipe), "--work-dir", str(work), *launch],
                       capture_output=True, text=True, timeout=400, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"resumed from {work / 'checkpoints' / f'step-{STEP}'} (step {STEP})" in r.stdout
    assert (work / "checkpoints" / f"step-{TOTAL}" / "COMPLETE").is_file()
    return work


def test_old_checkpoint_loads_the_saved_state(tmp_path):
    """The current trainer reads the old checkpoint: step, rollout state, LR schedule, weights."""
    from rlcli.config import load_recipe
    from rlcli.runner.setup import Environment
    from rlcli.train.checkpoint import capture_rng_state, read_meta, restore_rng_state

    ckpt = FIXTURE / "checkpoints" / f"step-{STEP}"
    assert read_meta(ckpt) == {"format": 1, "world_size": 1, "has_optimizer": True}
    recipe = load_recipe(recipe_copy(tmp_path))
    rng = capture_rng_state()  # loading restores the run's RNG: give the test process its own back
    try:
        worker = Environment(recipe, tmp_path / "work").build_train_worker(TOTAL)
        extra = worker.load_checkpoint(ckpt)
        assert extra["step"] == STEP and len(extra["managers"]) == 1
        manager = extra["managers"][0]
        assert manager["samplers"]["arith"]["position"] == 45 and len(manager["buffer"]["entries"]) == 5
        assert worker.scheduler.last_epoch == STEP
        assert worker.optimizer.state, "the Adam moments were not restored"
        tensors = {n: t.cpu() for bucket in worker.iter_weights() for n, t in bucket}
        assert_weights_match(tensors, f"step-{STEP}")
    finally:
        restore_rng_state(rng)


def test_old_checkpoint_resumes_to_the_recorded_run(tmp_path):
    """``rlcli train`` with auto_resume continues the old checkpoint to the rows 4fc714f logged."""
    from safetensors.torch import load_file

    work = resume(tmp_path, FIXTURE)
    got, want = rows(work / "metrics.jsonl"), rows(FIXTURE / "metrics-after-resume.jsonl")
    assert [g["step"] for g in got] == [w["step"] for w in want] == list(range(STEP + 1, TOTAL + 1))
    for g, w in zip(got, want):
        assert_rows_match(g, w)
    logged = [json.loads(x) for x in (work / "metrics.jsonl").read_text().splitlines()]
    assert all(r["agent_loop/errors"] == 0 for r in logged)
    assert_weights_match(load_file(str(work / "hf" / f"step-{TOTAL}" / "model.safetensors")), f"step-{TOTAL}")


@pytest.mark.slow
def test_old_disaggregated_checkpoint_resumes(tmp_path):
    """A 1 train + 1 rollout rank checkpoint of 4fc714f: placement, rollout stub, 35 buffered groups."""
    work = resume(tmp_path, DISAGG, "--nproc-per-node", "2")
    got, want = rows(work / "metrics.jsonl"), rows(DISAGG / "metrics-after-resume.jsonl")
    assert [g["step"] for g in got] == [w["step"] for w in want] == list(range(STEP + 1, TOTAL + 1))
    always = set.intersection(*(set(w) for w in want))  # the names every recorded row has
    for g in got:
        assert always <= set(g), (g["step"], sorted(always - set(g)))
    assert {k for g in got for k in g if not added(k)} <= {k for w in want for k in w}  # no other new name
    assert got[-1]["train/lr"] == want[-1]["train/lr"]
    ledger = [json.loads(x) for x in (work / "trained_groups.jsonl").read_text().splitlines()]
    before = [json.loads(x) for x in (DISAGG / "trained_groups.jsonl").read_text().splitlines()][:STEP]
    assert [r["step"] for r in ledger] == list(range(STEP + 1, TOTAL + 1))
    trained_before = {tuple(g) for r in before for g in r["groups"]}
    trained_after = [tuple(g) for r in ledger for g in r["groups"]]
    assert len(trained_after) == len(set(trained_after)) == (TOTAL - STEP) * 10
    assert not trained_before & set(trained_after), "a group trained before the checkpoint was trained again"
    saved = torch.load(work / "checkpoints" / f"step-{TOTAL}" / "extra_state.pt", weights_only=True)
    assert saved["step"] == TOTAL and saved["mode"] == "disaggregated"
    assert saved["placement"] == {"train": [0], "rollout": [1]}
