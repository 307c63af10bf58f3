"""The command line: validate, plugins, recipes, data, and bad-input handling (no model loads)."""

import json

import pytest
from click.testing import CliRunner

from rlcli.cli import cli


@pytest.fixture()
def runner():
    return CliRunner()


def test_help_is_fast_and_lists_commands(runner):
    out = runner.invoke(cli, ["--help"])
    assert out.exit_code == 0
    for cmd in ("train", "eval", "validate", "plugins", "recipes", "data"):
        assert cmd in out.output


def test_validate_ok(runner, repo):
    out = runner.invoke(cli, ["validate", str(repo / "recipes" / "quickstart.yaml")])
    assert out.exit_code == 0, out.output
    assert "tasks.0.judger: judger exact_match" in out.output


@pytest.mark.parametrize("overrides, expect", [
    (["trainer.sync_weights_interval=2", "trainer.checkpoint_interval=5"], "trainer.checkpoint_interval"),
    (["trainer.sync_weights_interval=2", "trainer.hf_interval=3"], "trainer.hf_interval"),
    (["trainer.sync_weights_interval=2", "trainer.evaluate_step=3"], "trainer.evaluate_step"),
    (["~trainer.total_train_steps"], "trainer.total_train_steps"),
    (["trainer.total_train_steps=0"], "trainer.total_train_steps"),
    (["trainer.sync_weights_interval=0"], "trainer.sync_weights_interval"),
    (["~eval"], "eval.tasks"),
    (["tasks.1={task_name: arith, sampler: {name: jsonl, path: data/arith.jsonl}, judger: {name: exact_match}}"],
     "tasks.1.task_name"),
    (["tasks.0.weight=0"], "tasks"),
    (["trainer.bogus=1"], "trainer.bogus"),
    (["tasks.0.judger.name=nope"], "tasks.0.judger.name"),
    (["tasks.0.judger.bogus=1"], "tasks.0.judger.bogus"),
    (["rollout.name=nope"], "rollout.name"),
    (["advantage.name=GRPO"], "advantage.name: unknown advantage_estimator 'GRPO'; available: dr_grpo, grpo"),
    (["advantage.name=GRPO"], "(did you mean 'grpo'?)"),
    (["trainer.lr=0.1"], "trainer.lr: unknown key here (did you mean train_worker.optimizer.lr?)"),
])
def test_validate_rejects_with_exit_2_and_no_side_effects(runner, repo, tmp_path, monkeypatch, overrides, expect):
    import transformers

    def boom(*a, **k):
        raise AssertionError("validate must not load a model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    work = tmp_path / "wd"
    args = ["validate", str(repo / "recipes" / "quickstart.yaml"), f"trainer.work_dir={work}", *overrides]
    out = runner.invoke(cli, args)
    assert out.exit_code == 2, out.output
    assert expect in out.output
    assert not work.exists()


def test_train_with_broken_recipe_fails_before_any_model(runner, repo, tmp_path, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("model loaded")))
    work = tmp_path / "wd"
    out = runner.invoke(cli, ["train", str(repo / "recipes" / "quickstart.yaml"), f"trainer.work_dir={work}",
                              "tasks.0.sampler.path=missing.jsonl"])
    assert out.exit_code == 2 and "missing.jsonl" in out.output
    assert not work.exists()


def test_plugins_json_lists_every_kind(runner):
    out = runner.invoke(cli, ["plugins", "--json"])
    assert out.exit_code == 0
    data = json.loads(out.output)
    kinds = {c["kind"] for c in data["components"]}
    assert {"judger", "inference_backend", "agent_loop", "produce_strategy", "replay_buffer"} <= kinds
    gsm = next(c for c in data["components"] if c["name"] == "gsm8k")
    assert gsm["distribution"] == "rlcli" and gsm["version"]


def test_math_verify_plugin_is_listed_when_installed(runner):
    pytest.importorskip("rlcli_math_verify", reason="pip install ./plugins/rlcli-math-verify")
    data = json.loads(runner.invoke(cli, ["plugins", "--json"]).output)
    mv = next(c for c in data["components"] if c["name"] == "math_verify")
    assert mv["kind"] == "judger" and mv["distribution"] == "rlcli-math-verify" and mv["version"] == "0.1.0"


def test_recipes_lists_builtins(runner):
    out = runner.invoke(cli, ["recipes"])
    assert out.exit_code == 0
    assert "quickstart.yaml" in out.output and "gsm8k-colocate.yaml" in out.output


@pytest.mark.parametrize("name", ["quickstart.yaml", "quickstart"])
def test_a_listed_recipe_name_validates_from_another_directory(runner, tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    out = runner.invoke(cli, ["validate", name])
    assert out.exit_code == 0, out.output
    assert "recipes/quickstart.yaml: OK" in out.output
    assert runner.invoke(cli, ["validate", "no-such-recipe"]).exit_code == 2


def test_data_gsm8k(runner, tmp_path):
    raw = tmp_path / "raw.jsonl"
    raw.write_text(json.dumps({"question": "2+3?", "answer": "it is 5\n#### 5"}) + "\n{broken\n")
    out_path = tmp_path / "out.jsonl"
    out = runner.invoke(cli, ["data", "gsm8k", str(raw), str(out_path)])
    assert out.exit_code == 0, out.output
    assert "wrote 1 rows" in out.output and "skipped 1" in out.output
    row = json.loads(out_path.read_text().splitlines()[0])
    assert row["reward_model"]["ground_truth"] == "5" and row["data_source"] == "openai/gsm8k"


def test_data_gsm8k_without_a_usable_row_exits_2_and_writes_nothing(runner, tmp_path):
    raw = tmp_path / "raw.jsonl"
    raw.write_text(json.dumps({"question": "2+3?"}) + "\n{broken\n")
    out = runner.invoke(cli, ["data", "gsm8k", str(raw), str(tmp_path / "out.jsonl")])
    assert out.exit_code == 2
    assert f"{raw}: no usable GSM8K row (2 malformed); nothing written to {tmp_path / 'out.jsonl'}" in out.output
    assert f"{raw}:1: missing 'answer'" in out.output and f"{raw}:2: " in out.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw.jsonl"]


@pytest.mark.parametrize("how", ["plain", "--debug", "RLCLI_DEBUG=1"])
def test_debug_prints_the_traceback_behind_a_one_line_error(runner, tmp_path, monkeypatch, how):
    raw = tmp_path / "raw.jsonl"
    raw.write_text(json.dumps({"question": "2+3?", "answer": "#### 5"}) + "\n")
    monkeypatch.setenv("RLCLI_DEBUG", "1" if how == "RLCLI_DEBUG=1" else "0")  # restored after the test
    args = ["--debug"] * (how == "--debug") + ["data", "gsm8k", str(raw), str(raw / "out.jsonl")]  # under a file
    out = runner.invoke(cli, args)
    assert out.exit_code == 2 and f"cannot convert {raw} to {raw / 'out.jsonl'}" in out.output
    assert ("Traceback (most recent call last)" in out.output) == (how != "plain")
    assert ("in convert_gsm8k" in out.output) == (how != "plain")  # where it was raised


def test_data_arith(runner, tmp_path):
    out = runner.invoke(cli, ["data", "arith", str(tmp_path)])
    assert out.exit_code == 0
    assert len((tmp_path / "arith.jsonl").read_text().splitlines()) == 100


def test_gsm8k_recipe_validates_with_a_model_path(runner, repo, tiny_llama_4k, tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text(json.dumps({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1?"}],
                                "reward_model": {"ground_truth": "2"}}) + "\n")
    out = runner.invoke(cli, ["validate", str(repo / "recipes" / "gsm8k-colocate.yaml"), f"model.path={tiny_llama_4k}",
                              f"tasks.0.sampler.path={data}", f"eval.tasks.0.sampler.path={data}"])
    assert out.exit_code == 0, out.output


def test_console_lines_say_what_was_measured():
    from rlcli.runner.records import final_summary, step_summary

    assert step_summary({"eval/accuracy": 0.25, "timing/step_s": 0.5}) == "eval/acc 0.250 | 0.50s"  # step 0: no reward
    line = step_summary({"reward/mean": 0.5, "train/loss": 3.7e-9, "train/grad_norm": 1.234, "timing/step_s": 1})
    assert line == "reward 0.500 | loss +3.70e-09 | grad_norm 1.23 | 1.00s"
    assert "loss -0.1235 " in step_summary({"train/loss": -0.12345})
    final = {"reward/mean": 0.5, "eval/accuracy": 0.75, "eval/engine/busy_s": 0.1, "eval/judger/calls": 3.0,
             "eval/agent_loop/errors": 0.0, "train/loss": 0.1}
    assert final_summary(final) == "reward/mean 0.5 | eval/accuracy 0.75"
    # rlcli eval: the metrics, and a failure counter only where something failed
    from rlcli.runner.records import eval_lines

    ev = {"eval/accuracy": 0.75, "eval/engine/busy_s": 0.1, "eval/judger/calls": 3.0, "eval/judger/crashes": 1.0,
          "eval/judger/timeouts": 0.0, "eval/failed": 0.0}
    assert eval_lines(ev) == ["eval/accuracy: 0.7500", "eval/failed: 0.0000", "eval/judger/crashes: 1.0000"]


def test_out_of_memory_names_the_keys_that_free_memory(runner, repo, tmp_path, monkeypatch):
    """A run that stops on CUDA out of memory (one rank, or any rank of several) exits 1 with torch's
    first line and the recipe keys that free memory; each key the hint names is a recipe key."""
    import re

    import torch

    import rlcli.runner
    from rlcli.cli import _out_of_memory_hint
    from rlcli.config import Recipe
    from rlcli.launch import RankFailed

    hint = _out_of_memory_hint()
    keys = set(re.findall(r"\b(?:resources|train_worker|model|rollout|trainer)(?:\.[a-z_]+)+", hint))
    assert {"resources.expandable_segments", "train_worker.fsdp.cpu_offload", "trainer.auto_resume"} <= keys
    for key in keys:
        model = Recipe
        for part in key.split("."):
            assert part in model.model_fields, f"{key}: {part} is not a recipe key"
            ann = model.model_fields[part].annotation
            model = next((a for a in getattr(ann, "__args__", (ann,)) if hasattr(a, "model_fields")), None)
            if model is None:
                break

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 890.00 MiB.\nmore detail")

    args = ["train", str(repo / "recipes" / "quickstart.yaml"), "--work-dir", str(tmp_path / "w"), "--quiet"]
    monkeypatch.setattr(rlcli.runner, "run", oom)
    result = runner.invoke(cli, args)
    assert result.exit_code == 1
    assert "Tried to allocate 890.00 MiB." in result.output and "more detail" not in result.output
    assert "train_worker.fsdp.cpu_offload=true" in result.output

    def rank_oom(*args, **kwargs):
        raise RankFailed("rank 1 failed", {1: "OutOfMemoryError: CUDA out of memory."})

    monkeypatch.setattr("rlcli.launch.launch", rank_oom)
    result = runner.invoke(cli, [*args, "--nproc-per-node", "2"])
    assert result.exit_code == 1 and "resources.expandable_segments" in result.output


def test_a_launched_rank_ends_its_process_group_before_it_exits(monkeypatch):
    """rank_entry destroys the process group once its run is done on every rank, so that the
    group's threads do not meet the interpreter's teardown (gloo can abort there; NCCL warns)."""
    import torch.distributed as dist

    import rlcli.config
    import rlcli.runner
    from rlcli.dist import init_distributed

    def fake_run(recipe, work_dir, **kw):
        init_distributed("cpu")
        assert dist.is_initialized()
        return work_dir, {"step": 1}

    monkeypatch.setattr(rlcli.config, "load_recipe", lambda path, overrides: object())
    monkeypatch.setattr(rlcli.runner, "run", fake_run)
    assert rlcli.runner.rank_entry("r.yaml", [], "/tmp/w", True, False) == ("/tmp/w", {"step": 1})
    assert not dist.is_initialized()
