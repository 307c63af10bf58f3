"""The tool-use recipes: the toy data, the CPU recipe that learns to call the calculator, GSM8K-tools."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from rlcli.cli import cli
from rlcli.data.tool_arith import TEST_FILE, TRAIN_FILE, tool_arith_rows, write_tool_arith


def rows(work):
    return [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]


def test_tool_arith_data_is_generated_deterministically(repo, tmp_path):
    out = CliRunner().invoke(cli, ["data", "tool-arith", str(tmp_path)])
    assert out.exit_code == 0, out.output
    for name in (TRAIN_FILE, TEST_FILE):  # the shipped files are exactly what the command writes
        assert (tmp_path / name).read_text() == (repo / "recipes" / "data" / name).read_text()
    train = [json.loads(x) for x in (tmp_path / TRAIN_FILE).read_text().splitlines()]
    test = [json.loads(x) for x in (tmp_path / TEST_FILE).read_text().splitlines()]
    assert (len(train), len(test)) == (1000, 200)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    for r in train + test:
        a, b = map(int, r["prompt"].split("*"))
        assert 10 <= a <= 999 and 10 <= b <= 999 and r["reward_model"]["ground_truth"] == str(a * b)
    assert len({r["prompt"] for r in train}) == 1000
    with pytest.raises(ValueError):
        tool_arith_rows(100, min_digits=1, max_digits=1)  # only 81 distinct 1-digit products
    assert write_tool_arith(tmp_path / "small", train=3, test=2)[0].read_text().count("\n") == 3


def test_gsm8k_tools_recipe_validates_with_a_model_path(repo, tiny_llama_4k, tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text(json.dumps({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1?"}],
                                "reward_model": {"ground_truth": "2"}}) + "\n")
    overrides = [f"model.path={tiny_llama_4k}", f"tasks.0.sampler.path={data}", f"eval.tasks.0.sampler.path={data}"]
    out = CliRunner().invoke(cli, ["validate", str(repo / "recipes" / "gsm8k-tools.yaml"), *overrides])
    assert out.exit_code == 0, out.output
    assert "tasks.0.agent_loop: agent_loop multi_turn" in out.output
    from rlcli.config import load_recipe

    rec = load_recipe(repo / "recipes" / "gsm8k-tools.yaml", overrides)
    loop = rec.tasks[0].agent_loop.cfg
    assert loop.tool_format.name == "hermes" and [t.name for t in loop.tools] == ["calculator"]
    assert '"name": "calculator"' in rec.tasks[0].sampler.cfg.system_prompt
    assert rec.eval.tasks[0].agent_loop.cfg.sample_params.temperature == 0.0


def _train(repo, work, *overrides):
    out = CliRunner().invoke(cli, ["train", str(repo / "recipes" / "tool-calculator.yaml"), "--work-dir", str(work),
                                   "--quiet", *overrides])
    assert out.exit_code == 0, out.output
    return rows(work)


@pytest.mark.slow
def test_tool_recipe_learns_to_call_the_calculator(repo, tmp_path):
    # one seed keeps the suite short; more seeds are a benchmark:
    # python benchmarks/quickstart_seeds.py --recipe recipes/tool-calculator.yaml --seeds 1 2 3
    r = _train(repo, tmp_path / "run", "trainer.seed=1")
    rewards = {x["step"]: x["reward/mean"] for x in r if "reward/mean" in x}
    evals = {x["step"]: x["eval/accuracy"] for x in r if "eval/accuracy" in x}
    assert rewards[1] <= 0.3 and evals[0] <= 0.3, (rewards[1], evals[0])
    last = max(rewards)
    assert sum(rewards[s] for s in range(last - 4, last + 1)) / 5 >= 0.8, rewards
    assert evals[last] >= 0.8, evals
    # it learned to use the calculator: "\n" evaluates the question, the answer is the tool's, then EOS
    final = [json.loads(x) for x in (tmp_path / "run" / "eval" / f"step-{last}.jsonl").read_text().splitlines()]
    good = [x for x in final if x["reward"] == 1.0]
    assert good and all(x["response"].startswith("\n") and x["finish_reason"] == "stop" for x in good)


@pytest.mark.slow
def test_without_the_calculator_the_task_is_not_learned(repo, tmp_path):
    no_tool = ["tasks.0.agent_loop={name: single_turn, sample_params: {max_tokens: 8, temperature: 1.0}}",
               "eval.tasks.0.agent_loop={name: single_turn, sample_params: {max_tokens: 8, temperature: 0.0}}"]
    r = _train(repo, tmp_path / "run", *no_tool)
    rewards = [x["reward/mean"] for x in r if "reward/mean" in x]
    evals = [x["eval/accuracy"] for x in r if "eval/accuracy" in x]
    assert len(rewards) == 60 and max(rewards) <= 0.02 and max(evals) <= 0.02, (max(rewards), max(evals))


@pytest.mark.slow
def test_gsm8k_tools_recipe_runs_a_step_with_a_tiny_model(repo, tiny_llama, tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}+{i}?"}],
                                        "reward_model": {"ground_truth": str(2 * i)}}) + "\n" for i in range(4)))
    out = CliRunner().invoke(cli, [
        "train", str(repo / "recipes" / "gsm8k-tools.yaml"), "--work-dir", str(tmp_path / "run"), "--quiet",
        f"model.path={tiny_llama}", f"tasks.0.sampler.path={data}", f"eval.tasks.0.sampler.path={data}",
        "trainer.total_train_steps=1", "trainer.train_batch_size=2", "tasks.0.sampler.prompt_repeat_k=2",
        "tasks.0.agent_loop.sample_params.max_tokens=64", "eval.tasks.0.agent_loop.sample_params.max_tokens=64",
        "eval.evaluator.sample_num=2", "trainer.enable_initial_evaluate=false", "rollout.max_batch_size=8",
        "rollout.max_model_len=512", "train_worker.gradient_checkpointing=false", "trainer.checkpoint_interval=-1",
        "tasks.0.sampler.max_prompt_length=400", "eval.tasks.0.sampler.max_prompt_length=400",  # + 64 fit 512
        "trainer.hf_interval=-1", "resources.device=cpu",
        # the tiny model has a character tokenizer and 512 positions: a short system prompt
        "tasks.0.sampler.system_prompt=use the calculator", "eval.tasks.0.sampler.system_prompt=use the calculator"])
    assert out.exit_code == 0, out.output
    r = rows(tmp_path / "run")
    assert r[-1]["step"] == 1 and "eval/accuracy" in r[-1]
