"""End to end on the CPU: the multi-token quickstart (recipes/quickstart-multitoken.yaml) learns
answers it never trained on, the engine and the trainer agree on every token, and async
production pauses responses in the middle and continues them.

The full learning table (seeds 1, 2, 3, 500 steps each) is a benchmark, not a test:
``python benchmarks/quickstart_seeds.py --recipe recipes/quickstart-multitoken.yaml --target 0.8``
(docs/benchmarks.md). The test here runs 300 steps of one seed and fails when the task stops learning.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from rlcli.cli import cli

RECIPE = "quickstart-multitoken.yaml"
ASYNC = ["tasks.0.produce_strategy={name: async, over_sample_threshold: 0.5, enable_partial_rollout: true, "
         "max_staleness: 1}", "replay_buffer.name=async", "trainer.sync_weights_interval=2", "rollout.max_batch_size=256",
         "train_worker.rollout_is={mode: truncate, threshold_upper: 2.0}"]


def rows(work):
    return [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]


def train(repo, work, *overrides):
    out = CliRunner().invoke(cli, ["train", str(repo / "recipes" / RECIPE), "--work-dir", str(work), "--quiet",
                                   "trainer.auto_resume=false", "trainer.checkpoint_interval=-1",
                                   "trainer.hf_interval=-1", *overrides])
    assert out.exit_code == 0, out.output
    return rows(work)


@pytest.mark.slow
def test_multitoken_quickstart_learns_held_out_strings(repo, tmp_path):
    r = train(repo, tmp_path / "run", "trainer.seed=3", "trainer.total_train_steps=300", "trainer.evaluate_step=300")
    evals = {x["step"]: x["eval/accuracy"] for x in r if "eval/accuracy" in x}
    assert sorted(evals) == [0, 300]
    # 300 of the recipe's 500 steps, to keep the suite short: on the machine of docs/benchmarks.md
    # seed 3 is at 0.42 then (0.17 at 250, 0.99 at 500); another CPU rounds differently and takes
    # another trajectory (an AMX-capable Xeon: 0.167 at 300, 2026-12-04), so the test asks for less -
    # but far above the 0.0 of an untrained model: 0.1 of the 2,287 held-out strings is 229 exact answers
    assert evals[0] <= 0.05 and evals[300] >= 0.1, evals
    steps = [x for x in r if x["step"] > 0]
    # answers of several tokens that end with EOS: 2-4 digits + EOS, few cut off at the end
    assert 2.5 <= steps[-1]["response/length_mean"] <= 5.0 and steps[-1]["response/truncated_frac"] < 0.05
    # the engine and the trainer agree on every token of every step (float32 on the CPU)
    assert all(x["mismatch/logprob_abs_diff"] <= 1e-4 for x in steps)
    assert all({"mismatch/logprob_abs_diff_max", "mismatch/k3_kl"} <= set(x) for x in steps)
    assert all(x["train/entropy"] > 0 for x in steps)


@pytest.mark.slow
def test_multitoken_async_pauses_responses_mid_way_and_continues_them(repo, tmp_path):
    r = train(repo, tmp_path / "async", *ASYNC, "trainer.total_train_steps=40", "trainer.evaluate_step=40")
    steps = [x for x in r if x["step"] > 0]
    assert [x["step"] for x in steps] == list(range(1, 41))
    # responses paused with some of their tokens, then continued after the weight sync: in the
    # early steps, while responses are long; once the model answers in a few tokens, the rows in
    # flight at a pause mostly finish within the lockstep engine's 8-step hand-out window instead
    continued = [x["rollout/partial_resumed_samples"] > 0 for x in steps[1:6]]
    assert sum(continued) >= 4, [x["rollout/partial_resumed_samples"] for x in steps]
    assert sum(x["rollout/partial_resumed_samples"] for x in steps) >= 300
    # staleness never passes (max_staleness + 1) * sync_weights_interval - 1 = 3
    assert max(x["rollout/staleness_max"] for x in steps) <= 3
    assert all(x["rollout/groups"] == 128 for x in steps)


def test_without_return_logprob_training_runs_and_logs_no_mismatch(repo, tmp_path):
    """``sample_params.return_logprob: false``: the engine returns no logprobs, the samples carry
    none, training runs on, and the mismatch/* metrics are left out rather than logged as 0."""
    r = train(repo, tmp_path / "nolp", "tasks.0.agent_loop.sample_params.return_logprob=false",
              "trainer.total_train_steps=3", "trainer.enable_evaluate=false")
    steps = [x for x in r if x["step"] > 0]
    assert [x["step"] for x in steps] == [1, 2, 3]
    assert all(x["train/tokens"] > 0 and x["train/grad_norm"] > 0 for x in steps)
    assert not any(k.startswith("mismatch/") or k == "train/rollout_logprob_diff" for x in steps for k in x)
