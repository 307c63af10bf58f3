"""A run that diverged never writes its weights (rlcli/train/divergence.py): the checkpoint and
the HF export refuse NaN or inf weights, a step that skips its update checks them, and the CLI
ends with one line naming the cause, the last good checkpoint intact."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from rlcli.algo.loss import VanillaPolicyLoss
from rlcli.cli import cli
from rlcli.config import ModelConfig, TrainWorkerConfig
from rlcli.models import tiny_model_dir
from rlcli.train.divergence import DivergedError, weights_finite
from rlcli.train.worker import TrainWorker


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("div-model") / "m", arch="qwen2", seed=3)


def test_nan_weights_are_never_written(model_dir, tmp_path):
    w = TrainWorker(model_dir, ModelConfig(), TrainWorkerConfig(), VanillaPolicyLoss(), device="cpu", seed=0,
                    total_steps=2)
    assert weights_finite(w.model.parameters())
    w.save_checkpoint(tmp_path / "good", {"step": 0})
    with torch.no_grad():
        next(iter(w.model.parameters())).to_local().view(-1)[0] = float("nan")
    assert not weights_finite(w.model.parameters())
    with pytest.raises(DivergedError, match="NaN or inf .* before writing .*bad"):
        w.save_checkpoint(tmp_path / "bad", {"step": 1})
    with pytest.raises(DivergedError, match="before writing .*hf"):
        w.save_hf(tmp_path / "hf")
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad.tmp").exists() and not (tmp_path / "hf").exists()
    assert (tmp_path / "good" / "COMPLETE").exists()


@pytest.mark.parametrize("interval, where", [(1, "step 1, before writing"),
                                             (2, "step 2, at a step whose loss or gradient was not finite")])
def test_a_diverging_run_stops_with_its_cause_and_writes_no_checkpoint_of_it(repo, tmp_path, interval, where):
    """lr 1e39: the first update makes every weight non-finite. With a checkpoint after every step it
    is refused; otherwise the next step's NaN loss skips its update and the check stops the run."""
    work = tmp_path / "w"
    res = CliRunner().invoke(cli, ["train", str(repo / "recipes" / "quickstart.yaml"), "--work-dir", str(work),
                                   "--quiet", "train_worker.optimizer={lr: 1.0e39}", "trainer.total_train_steps=4",
                                   f"trainer.checkpoint_interval={interval}", "trainer.train_batch_size=20",
                                   "eval.evaluator.sample_num=20"])
    assert res.exit_code == 1, res.output
    assert f"training failed: the weights hold NaN or inf values by optimizer {where}" in res.output
    assert not (work / "checkpoints").exists() and not (work / "hf").exists()
