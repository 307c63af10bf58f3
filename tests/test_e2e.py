"""End to end on the CPU: the quickstart learns, eval reproduces it, plugins and failures behave."""

import asyncio
import json

import pytest
import torch
import yaml
from click.testing import CliRunner

from rlcli import hookimpl
from rlcli.agent_loops import SingleTurnAgentLoop
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
                "timing/step_s", "timing/sleep_s", "timing/wake_up_s", "rollout/tokens"}
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


def _fit(repo, raw, plugin) -> list[dict]:
    """Train ``raw`` (a recipe dict) in this process with ``plugin`` registered; its metrics rows."""
    rec = validate_recipe(raw, registry=registry_with(plugin), base_dir=repo / "recipes")
    runner = ColocateRunner(rec, quiet=True)
    try:
        runner.fit()
    finally:
        runner.close()
    return rows(runner.work_dir)


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

    r = _fit(repo, _short(repo, tmp_path / "flaky", judger), FlakyPlugin())
    assert [x["step"] for x in r] == [0, 1, 2, 3]
    assert all(x["judger/errors"] > 0 and x["judger/timeouts"] > 0 for x in r[1:])
    assert all(x["rollout/failed_samples"] == x["judger/errors"] + x["judger/timeouts"] for x in r[1:])


class Raising(SingleTurnAgentLoop):
    """Raises on one sample in ten (training and evaluation)."""

    name = "raising"

    async def run_sample(self, sample):
        if sample.uid % 10 == 3:
            raise ValueError(f"raising loop on uid {sample.uid}")
        return await super().run_sample(sample)


class RaisingPlugin:
    @hookimpl
    def register_agent_loops(self):
        return [Raising]


def test_agent_loop_errors_fail_samples_not_the_run(repo, tmp_path):
    def loop(raw):
        raw["trainer"]["total_train_steps"] = 2
        for t in (raw["tasks"][0], raw["eval"]["tasks"][0]):
            t["agent_loop"] = {**t.get("agent_loop", {}), "name": "raising"}

    r = _fit(repo, _short(repo, tmp_path / "raising", loop), RaisingPlugin())
    assert [x["step"] for x in r] == [0, 1, 2]
    for x in r[1:]:  # 40 samples a step, uids 0..39 of the groups drawn: 4 raise
        assert x["agent_loop/errors"] == x["rollout/failed_samples"] > 0 and x["judger/errors"] == 0
        assert x["rollout/samples"] == 40 - x["agent_loop/errors"]
    assert all(x["eval/agent_loop/errors"] == 10 for x in r)  # 100 eval prompts, 1 sample each
    log = (tmp_path / "raising" / "run.log").read_text()
    assert log.count("Traceback (most recent call last)") >= 10 and "ValueError: raising loop on uid 3" in log


class HangsOnce(SingleTurnAgentLoop):
    """Awaits forever on one training sample in ten (a tool server that never answers)."""

    name = "hangs_once"

    async def run_sample(self, sample):
        if sample.uid % 10 == 3 and self.salt.startswith("train"):
            await asyncio.Event().wait()
        return await super().run_sample(sample)


class HangsOncePlugin:
    @hookimpl
    def register_agent_loops(self):
        return [HangsOnce]


def test_an_agent_loop_that_never_returns_fails_its_group_past_timeout_s(repo, tmp_path):
    def loop(raw):
        raw["trainer"]["total_train_steps"] = 2
        raw["tasks"][0]["agent_loop"] = {**raw["tasks"][0].get("agent_loop", {}), "name": "hangs_once",
                                         "timeout_s": 1.0}

    r = _fit(repo, _short(repo, tmp_path / "hangs", loop), HangsOncePlugin())
    assert [x["step"] for x in r] == [0, 1, 2]
    for x in r[1:]:  # the hanging sample fails; its group's other members finished before the timeout
        assert x["agent_loop/errors"] >= 1 and x["rollout/failed_samples"] >= x["agent_loop/errors"]
    assert "agent_loop.timeout_s=1 s; it was cancelled" in (tmp_path / "hangs" / "run.log").read_text()


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


def test_throughput_of_several_ranks():
    """Each rank's generation rate adds up to the job's; the training rate is the step's trained tokens
    (already global) over the train phase; a row without training gets none."""
    from rlcli.runner.ranks import merge_metrics
    from rlcli.runner.records import ROLLOUT_TOKENS_PER_S, TRAIN_TOKENS_PER_S, add_train_throughput, per_second

    ranks = [{"rollout/tokens": 100.0, "timing/rollout_s": 2.0, "rollout/samples": 4.0, "train/tokens": 300.0,
              "timing/train_s": 1.0},
             {"rollout/tokens": 60.0, "timing/rollout_s": 1.0, "rollout/samples": 4.0, "train/tokens": 300.0,
              "timing/train_s": 3.0}]
    for r in ranks:
        r[ROLLOUT_TOKENS_PER_S] = per_second(r["rollout/tokens"], r["timing/rollout_s"])
    row = merge_metrics(ranks)
    add_train_throughput(row)
    assert row[ROLLOUT_TOKENS_PER_S] == 50.0 + 60.0 and row[TRAIN_TOKENS_PER_S] == 300.0 / 2.0
    eval_only = {"eval/accuracy": 1.0}
    add_train_throughput(eval_only)
    assert eval_only == {"eval/accuracy": 1.0} and per_second(5.0, 0.0) == 0.0


def test_a_rollout_without_a_trainable_group_aborts_the_step_before_training(repo, tmp_path):
    """Behaviour 63: an empty rollout result ends the run at that step, before the backend is put
    to sleep or the trainer runs; the step counter and the logged rows stay where they were."""
    def short(raw):
        raw["trainer"].update(total_train_steps=2, enable_evaluate=False)

    rec = validate_recipe(_short(repo, tmp_path / "w", short), base_dir=repo / "recipes")
    runner = ColocateRunner(rec, quiet=True)
    calls = []
    strategy = runner.manager.tasks[0].strategy
    produce = strategy.produce_batch
    runner.backend.sleep = lambda *a, f=runner.backend.sleep: calls.append("sleep") or f(*a)
    runner.worker.train_step = lambda seqs, f=runner.worker.train_step: calls.append("train") or f(seqs)

    async def nothing_at_step_2(task, ctx):  # step 1 as usual; step 2 leaves no group
        if ctx.train_step == 1:
            await produce(task, ctx)

    strategy.produce_batch = nothing_at_step_2
    try:
        with pytest.raises(RuntimeError, match="rollout produced no trainable group"):
            runner.fit()
        assert runner.step == 1 and calls == ["sleep", "train"]  # step 1 only
    finally:
        runner.close()
    assert [x["step"] for x in rows(tmp_path / "w")] == [1]


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
