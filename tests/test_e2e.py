"""End to end on the CPU: the quickstart learns, eval reproduces it, plugins and failures behave."""

import json

import pytest
import torch
import yaml
from click.testing import CliRunner

from rlcli import hookimpl
from rlcli.cli import cli
from rlcli.config import validate_recipe
from rlcli.judgers.base import Judger
from rlcli.plugins import registry_with
from rlcli.runner.colocate import ColocateRunner


def rows(work):
    return [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def quickstart_run(repo, tmp_path_factory):
    work = tmp_path_factory.mktemp("qs") / "run"
    out = CliRunner().invoke(cli, ["train", str(repo / "recipes" / "quickstart.yaml"), "--work-dir", str(work),
                                   "--quiet", "trainer.seed=1"])
    assert out.exit_code == 0, out.output
    return work


@pytest.mark.slow
def test_quickstart_learns(quickstart_run):
    r = rows(quickstart_run)
    evals = {x["step"]: x["eval/accuracy"] for x in r if "eval/accuracy" in x}
    assert evals[0] <= 0.3
    last = max(evals)
    assert last == 300 and evals[last] >= 0.9, evals
    required = {"step", "time", "reward/mean", "response/length_mean", "train/loss", "train/grad_norm", "train/lr",
                "train/entropy", "train/clipfrac", "timing/rollout_s", "timing/train_s", "timing/sync_s",
                "timing/step_s", "rollout/tokens"}
    for x in r[1:]:
        assert required <= set(x), required - set(x)
        # the engine's own counters: what it generated is what the rollout recorded
        assert x["engine/generated_tokens"] == x["rollout/tokens"] > 0 and x["engine/busy_s"] > 0
    assert all(x["eval/engine/generated_tokens"] > 0 for x in r if "eval/accuracy" in x)  # counted apart
    assert [x["step"] for x in r] == list(range(0, 301))


@pytest.mark.slow
def test_quickstart_outputs(quickstart_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    w = quickstart_run
    resolved = yaml.safe_load((w / "resolved.yaml").read_text())
    assert resolved["recipe"]["trainer"]["seed"] == 1 and "tasks.0.judger" in resolved["plugins"]
    assert list((w / "tensorboard").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (w / "checkpoints").iterdir()) == ["step-200", "step-300"]  # maxkeep 2
    hf = w / "hf" / "step-300"
    model = AutoModelForCausalLM.from_pretrained(hf)
    tok = AutoTokenizer.from_pretrained(hf)
    assert model.config.vocab_size >= len(tok)
    assert len((w / "eval" / "step-300.jsonl").read_text().splitlines()) == 100


@pytest.mark.slow
@pytest.mark.parametrize("which", ["hf/step-300", "checkpoints/step-300"])
def test_eval_reproduces_final_accuracy(quickstart_run, repo, tmp_path, which):
    final = [x for x in rows(quickstart_run) if "eval/accuracy" in x][-1]["eval/accuracy"]
    out_dir = tmp_path / "ev"
    res = CliRunner().invoke(cli, ["eval", str(repo / "recipes" / "quickstart.yaml"), "--checkpoint",
                                   str(quickstart_run / which), "--out-dir", str(out_dir),
                                   f"trainer.work_dir={quickstart_run}"])
    assert res.exit_code == 0, res.output
    metrics = json.loads((out_dir / "eval_metrics.json").read_text())
    assert abs(metrics["eval/accuracy"] - final) <= 0.02
    lines = [json.loads(x) for x in (out_dir / "eval.jsonl").read_text().splitlines()]
    assert len(lines) == 100 and {"prompt", "response", "reward", "data_source"} <= set(lines[0])


def _short(repo, work, *overrides):
    raw = yaml.safe_load((repo / "recipes" / "quickstart.yaml").read_text())
    raw["trainer"].update(total_train_steps=3, evaluate_step=1, checkpoint_interval=-1, work_dir=str(work))
    raw["tasks"][0]["sampler"]["prompt_repeat_k"] = 4
    raw["trainer"]["train_batch_size"] = 10
    for ov in overrides:
        ov(raw)
    return raw


def test_math_verify_recipe_runs_two_steps(repo, tmp_path):
    pytest.importorskip("rlcli_math_verify", reason="pip install ./plugins/rlcli-math-verify")
    work = tmp_path / "mv"
    res = CliRunner().invoke(cli, ["train", str(repo / "recipes" / "quickstart.yaml"), "--work-dir", str(work),
                                   "--quiet", "trainer.total_train_steps=2", "trainer.train_batch_size=10",
                                   "tasks.0.judger={name: math_verify, executor: thread}",
                                   "eval.tasks.0.judger={name: math_verify, executor: thread}",
                                   "eval.evaluator.sample_num=20"])
    assert res.exit_code == 0, res.output
    r = rows(work)
    assert [x["step"] for x in r] == [0, 1, 2]
    assert r[-1]["judger/errors"] == 0 and r[-1]["judger/calls"] > 0
    assert "math_verify from rlcli-math-verify 0.1.0" in (work / "resolved.yaml").read_text()


class Flaky(Judger):
    """Raises on every third call, hangs on every seventh."""

    name = "flaky"

    def judge(self, response, label, sample):
        if sample.uid % 7 == 3:
            import time

            time.sleep(5)
        if sample.uid % 3 == 0:
            raise ValueError("flaky judger")
        return float(response.strip() == str(label))


class FlakyPlugin:
    @hookimpl
    def register_judgers(self):
        return [Flaky]


def test_judger_errors_and_hangs_fail_samples_not_the_run(repo, tmp_path):
    def judger(raw):
        raw["tasks"][0]["judger"] = {"name": "flaky", "executor": "thread", "timeout_s": 0.2}

    raw = _short(repo, tmp_path / "flaky", judger)
    rec = validate_recipe(raw, registry=registry_with(FlakyPlugin()), base_dir=repo / "recipes")
    runner = ColocateRunner(rec, quiet=True)
    try:
        runner.fit()
    finally:
        runner.close()
    r = rows(tmp_path / "flaky")
    assert [x["step"] for x in r] == [0, 1, 2, 3]
    assert all(x["judger/errors"] > 0 and x["judger/timeouts"] > 0 for x in r[1:])
    assert all(x["rollout/failed_samples"] == x["judger/errors"] + x["judger/timeouts"] for x in r[1:])


def test_fresh_run_refuses_a_used_work_dir(repo, tmp_path):
    work = tmp_path / "used"
    args = ["train", str(repo / "recipes" / "quickstart.yaml"), "--work-dir", str(work), "--quiet",
            "trainer.total_train_steps=1", "trainer.train_batch_size=10", "trainer.auto_resume=false",
            "eval.evaluator.sample_num=10"]
    assert CliRunner().invoke(cli, args).exit_code == 0
    again = CliRunner().invoke(cli, args)
    assert again.exit_code == 2 and "already holds a run" in again.output
    assert CliRunner().invoke(cli, [*args, "--overwrite"]).exit_code == 0
    assert [x["step"] for x in rows(work)] == [0, 1]


def test_a_closed_runner_frees_its_trainer(repo, tmp_path):
    """The runner exempts its start-up heap from the garbage collector while it runs; once closed,
    a trainer held only through a reference cycle (a wrapped method, as the benchmarks do) is freed
    with its weights and optimizer state instead of staying for the life of the process."""
    import gc
    import weakref

    def short(raw):
        raw["trainer"].update(total_train_steps=1, enable_evaluate=False)

    rec = validate_recipe(_short(repo, tmp_path / "w", short), base_dir=repo / "recipes")
    runner = ColocateRunner(rec, quiet=True)
    orig = runner.worker.train_step
    runner.worker.train_step = lambda seqs, f=orig: f(seqs)  # worker -> lambda -> bound method -> worker
    worker = weakref.ref(runner.worker)
    try:
        runner.fit()
    finally:
        runner.close()
    del runner, orig
    gc.collect()
    assert worker() is None


@pytest.mark.parametrize("live", [True, False])
def test_weight_sync_gives_the_engine_the_trainers_weights(repo, tmp_path, monkeypatch, live):
    """After each step the engine holds exactly the trainer's weights, whether the trainer lends
    its parameters (a backend that copies them itself) or sends cast copies (any other backend)."""
    def short(raw):
        raw["trainer"].update(total_train_steps=2, enable_evaluate=False)

    rec = validate_recipe(_short(repo, tmp_path / "w", short), base_dir=repo / "recipes")
    runner = ColocateRunner(rec, quiet=True)
    if not live:
        monkeypatch.setattr(type(runner.backend), "accepts_live_weights", False)
    lent = []
    orig = runner.worker.iter_weights
    runner.worker.iter_weights = lambda *a, **k: lent.append(k.get("live", False)) or orig(*a, **k)
    try:
        runner.fit()
        assert lent[:2] == [live, live]  # the two syncs (a final HF export may follow)
        engine = runner.backend.engine.model.named_parameters()
        trainer = runner.worker.full_state_dict()
        assert set(engine) == set(trainer)
        for name, t in trainer.items():
            assert torch.equal(engine[name].detach().cpu(), t.to(engine[name].dtype).cpu()), name
        rows = [json.loads(x) for x in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["sync/bytes"] == sum({t.data_ptr(): t.numel() * t.element_size() for t in engine.values()}.values())
    finally:
        runner.close()
