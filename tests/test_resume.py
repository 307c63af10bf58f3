"""Resume is exact: a run SIGKILLed and auto-resumed ends identical to one never interrupted.

Each run is a real `rlcli train` subprocess on the CPU. The kill is a real SIGKILL from outside
(after a checkpoint is complete) or, to hit the middle of a checkpoint write, from the fault
point inside the writer (`RLCLI_FAULT`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlcli.runner.records import is_wall_time

RLCLI = [sys.executable, "-m", "rlcli.cli"]


def base_args(repo: Path, work: Path, steps: int, strategy: str) -> list[str]:
    args = [*RLCLI, "train", str(repo / "recipes" / "quickstart.yaml"), "--work-dir", str(work), "--quiet",
            f"trainer.total_train_steps={steps}", "trainer.train_batch_size=20", "trainer.checkpoint_interval=4",
            "trainer.checkpoint_maxkeep=-1", "trainer.evaluate_step=4", "trainer.auto_resume=true",
            "eval.evaluator.sample_num=20", "resources.num_threads=1"]
    if strategy == "async":
        args += ["tasks.0.produce_strategy={name: async, over_sample_threshold: 0.5, max_staleness: 1, "
                 "enable_partial_rollout: true}", "replay_buffer.name=async"]
    return args


def stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not is_wall_time(k)}


def metrics(work: Path) -> list[dict]:
    return [stable(json.loads(x)) for x in (work / "metrics.jsonl").read_text().splitlines()]


def weights(work: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(work / "hf" / f"step-{step}" / "model.safetensors"))


def assert_same_run(a: Path, b: Path, step: int) -> None:
    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in ma] == [r["step"] for r in mb] == list(range(step + 1))
    for ra, rb in zip(ma, mb):
        assert ra == rb, {k: (ra.get(k), rb.get(k)) for k in set(ra) | set(rb) if ra.get(k) != rb.get(k)}
    wa, wb = weights(a, step), weights(b, step)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def run(args: list[str], env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def kill_after_checkpoint(args: list[str], work: Path, step: int, last: int) -> None:
    """Start ``rlcli train`` (``args``), SIGKILL it once ``checkpoints/step-<step>`` is complete, and
    check that it had not finished (no ``hf/step-<last>``)."""
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    marker = work / "checkpoints" / f"step-{step}" / "COMPLETE"
    deadline = time.time() + 240
    while not marker.exists():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, f"no step-{step} checkpoint in time"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (work / "hf" / f"step-{last}").exists(), "the run finished before the kill; the test proves nothing"


@pytest.fixture(scope="module")
def uninterrupted(repo, tmp_path_factory):
    runs = {}
    for strategy in ("sync", "async"):
        work = tmp_path_factory.mktemp(f"full-{strategy}") / "run"
        r = run(base_args(repo, work, 12, strategy))
        assert r.returncode == 0, r.stderr[-3000:]
        runs[strategy] = work
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["sync", "async"])
def test_sigkill_after_checkpoint_then_resume_is_identical(repo, tmp_path, uninterrupted, strategy):
    work = tmp_path / "run"
    kill_after_checkpoint(base_args(repo, work, 12, strategy), work, 4, 12)
    r = run(base_args(repo, work, 12, strategy))
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_run(uninterrupted[strategy], work, 12)


@pytest.mark.slow
def test_sigkill_during_checkpoint_write_keeps_previous_checkpoint(repo, tmp_path, uninterrupted):
    from rlcli.train.checkpoint import latest_checkpoint

    work = tmp_path / "run"
    r = run(base_args(repo, work, 12, "sync"), env={"RLCLI_FAULT": "checkpoint:after_weights:step-8"})
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    assert (work / "checkpoints" / "step-8.tmp").is_dir()  # killed mid-write
    assert not (work / "checkpoints" / "step-8").exists()
    assert latest_checkpoint(work / "checkpoints") == work / "checkpoints" / "step-4"
    r = run(base_args(repo, work, 12, "sync"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (work / "checkpoints" / "step-8.tmp").exists()
    assert_same_run(uninterrupted["sync"], work, 12)


# the async variant in quickstart-multitoken.yaml's header: 50 % over-sampled groups queue behind 256 decode
# slots and the groups still running at a step's end are paused mid-response and continued later
MULTI_TOKEN_ASYNC = ["tasks.0.produce_strategy={name: async, over_sample_threshold: 0.5, enable_partial_rollout: true, "
                     "max_staleness: 1}", "replay_buffer.name=async", "trainer.sync_weights_interval=2",
                     "rollout.max_batch_size=256"]
# sync production with dynamic sampling (replacement groups start while others decode) and rollout IS
# (the engine's logprobs, which depend on the batch a row decoded in, reach the loss)
MULTI_TOKEN_DYNAMIC_IS = ["tasks.0.group_filters=[{name: all_equal_rewards}]",
                          "train_worker.rollout_is={mode: truncate, threshold_upper: 2.0}"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["sync", "sync-dynamic-is", "async"])
def test_multi_token_run_resumes_identical(repo, tmp_path, strategy):
    """The same with answers of several tokens ending at EOS (quickstart-multitoken: 2-4 digits and
    EOS), where the engine's batches mix rows of different lengths. It holds because the embedded
    engine steps in lockstep with the event loop (``rollout.lockstep``, on by default): without it
    the async weight-sync pause lands a timing-dependent number of decode steps late, and dynamic
    sampling's replacement groups join batches that depend on timing, so the engine's logprobs, and
    with rollout IS the loss, differ (docs/async.md, "Reproducibility")."""
    extra = {"sync": [], "sync-dynamic-is": MULTI_TOKEN_DYNAMIC_IS, "async": MULTI_TOKEN_ASYNC}[strategy]

    def args(work: Path) -> list[str]:
        return [*RLCLI, "train", str(repo / "recipes" / "quickstart-multitoken.yaml"), "--work-dir", str(work),
                "--quiet", "trainer.total_train_steps=12", "trainer.train_batch_size=128",
                "trainer.checkpoint_interval=4", "trainer.checkpoint_maxkeep=-1", "trainer.evaluate_step=4",
                "trainer.auto_resume=true", "eval.evaluator.sample_num=32", "trainer.log_every=100",
                *extra]

    full = tmp_path / "full"
    r = run(args(full))
    assert r.returncode == 0, r.stderr[-3000:]
    work = tmp_path / "run"
    kill_after_checkpoint(args(work), work, 4, 12)
    r = run(args(work))
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_run(full, work, 12)
    rows = metrics(work)
    assert max(m.get("response/length_mean", 0) for m in rows) > 2  # several tokens, not one
    if strategy == "async":  # responses were paused mid-way and continued: the case that needs lockstep
        assert sum(m.get("rollout/partial_resumed_samples", 0) for m in rows) > 0
