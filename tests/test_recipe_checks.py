"""What `validate` (and `train`, before any model) catches beyond the sections' own fields: odd
recipe files, the model's shape, lengths against the context and a pack, ranks against the
batch, tasks that never get a group; and a judger's absurd score (issue 28, items 7 to 9)."""

import asyncio
import json
import logging

import pytest
import yaml
from click.testing import CliRunner

from rlcli.cli import cli
from rlcli.config import RecipeError, check_launch, load_recipe, read_yaml, validate_recipe
from rlcli.config.yaml_file import MAX_DEPTH

from .conftest import REPO

QUICKSTART = REPO / "recipes" / "quickstart.yaml"


@pytest.fixture()
def raw():
    return yaml.safe_load(QUICKSTART.read_text())


def issues_of(raw_data, **kw):
    with pytest.raises(RecipeError) as ei:
        validate_recipe(raw_data, base_dir=REPO / "recipes", **kw)
    return {i.path: i.message for i in ei.value.issues}


# ------------------------------------------------------------------------------ the recipe file
@pytest.mark.parametrize("encode, words", [
    (lambda t: t.encode("utf-16"), "the file is UTF-16"),
    (lambda t: t.encode("utf-32"), "the file is UTF-32"),
    (lambda t: t.encode("utf-16-le"), "line 1: the file holds NUL bytes"),
    (lambda t: t.replace("seed: 1", "seed: 1 # caf\udce9").encode("utf-8", "surrogateescape"),
     "line 15: not valid UTF-8 (byte 0xe9"),
])
def test_a_recipe_that_is_not_utf8_is_refused_with_its_line(tmp_path, encode, words):
    p = tmp_path / "r.yaml"
    p.write_bytes(encode(QUICKSTART.read_text()))
    with pytest.raises(RecipeError) as ei:
        read_yaml(p)
    assert words in str(ei.value) and "save" in str(ei.value) and str(p) in str(ei.value)


def test_a_utf8_byte_order_mark_is_fine(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_bytes(b"\xef\xbb\xbf" + QUICKSTART.read_bytes())
    assert read_yaml(p) == yaml.safe_load(QUICKSTART.read_text())


@pytest.mark.parametrize("text, line", [
    ("a: " + "[" * 5000 + "]" * 5000 + "\n", 1),
    ("".join(" " * i + f"k{i}:\n" for i in range(MAX_DEPTH + 5)), MAX_DEPTH + 1),
])
def test_deep_nesting_is_refused_without_recursion(tmp_path, text, line):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    with pytest.raises(RecipeError, match=f"line {line}: mappings and lists nest more than {MAX_DEPTH} levels"):
        read_yaml(p)
    p.write_text("".join(" " * i + f"k{i}:\n" for i in range(MAX_DEPTH)))  # at the limit: read
    assert read_yaml(p)["k0"]["k1"] is not None


def test_duplicate_keys_are_refused_naming_both_lines(tmp_path):
    text = QUICKSTART.read_text().replace("  seed: 1\n", "  seed: 1\n  seed: 2\n")
    text += "tasks: []\n"
    p = tmp_path / "r.yaml"
    p.write_text(text)
    with pytest.raises(RecipeError) as ei:
        load_recipe(p)
    found = {i.path: i.message for i in ei.value.issues}
    assert found.keys() == {"trainer.seed", "tasks"}
    assert "on lines 15 and 16" in found["trainer.seed"] and "silently keep the last value" in found["trainer.seed"]
    p.write_text("a: {b: 1, b: 2}\nbase: &x {c: 1}\nd:\n  <<: *x\n  c: 2\n")  # merges are not repeats
    with pytest.raises(RecipeError) as ei:
        read_yaml(p)
    assert [(i.path, "line 1 (columns 5 and 11)" in i.message) for i in ei.value.issues] == [("a.b", True)]


# ---------------------------------------------------------------------------------- the model
@pytest.mark.parametrize("change, path, words", [
    ({"num_attention_heads": 5}, "model.from_scratch.num_attention_heads",
     "num_attention_heads=5 does not divide hidden_size=64"),
    ({"num_key_value_heads": 3}, "model.from_scratch.num_key_value_heads",
     "num_key_value_heads=3 does not divide num_attention_heads=4"),
    ({"hidden_size": 60}, "model.from_scratch.num_attention_heads", "= 15 dimensions per head"),
])
def test_from_scratch_heads(raw, change, path, words):
    raw["model"]["from_scratch"].update(change)
    assert words in issues_of(raw)[path]


def test_a_pretrained_models_config_json_is_checked_without_loading_it(raw, tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    cfg = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 3, "max_position_embeddings": 16}
    (model / "config.json").write_text(json.dumps(cfg))
    raw["model"] = {"path": str(model), "tokenizer": "builtin:digits"}
    raw["tasks"][0]["sampler"]["max_prompt_length"] = 10
    raw["tasks"][0]["agent_loop"]["sample_params"]["max_tokens"] = 8
    found = issues_of(raw)
    assert "num_key_value_heads=3 does not divide num_attention_heads=4 (in " in found["model.path"]
    assert found["tasks.0.agent_loop.sample_params.max_tokens"].startswith(
        "tasks.0.sampler.max_prompt_length=10 + tasks.0.agent_loop.sample_params.max_tokens=8 = 18 tokens, more "
        "than the model's max_position_embeddings=16")
    cfg.update(num_key_value_heads=2, num_attention_heads=5, head_dim=16)  # an explicit head_dim may not divide
    (model / "config.json").write_text(json.dumps(cfg))
    raw["tasks"][0]["sampler"]["max_prompt_length"] = 8
    assert set(issues_of(raw)) == {"model.path"}  # only the key/value heads: 2 does not divide 5


def test_lengths_against_the_context_the_pack_and_max_model_len(raw):
    raw["eval"]["tasks"][0]["agent_loop"]["sample_params"]["max_tokens"] = 64
    raw["train_worker"]["pack_max_length"] = 11
    raw["tasks"][0]["sampler"]["max_prompt_length"] = 12
    raw["rollout"]["max_model_len"] = 128
    found = issues_of(raw)
    assert "max_tokens=64 leaves no room for a prompt" in found["eval.tasks.0.agent_loop.sample_params.max_tokens"]
    assert found["train_worker.pack_max_length"] == (  # the eval task is not trained: only tasks.0 counts
        "pack_max_length=11 is shorter than one sequence of tasks.0: tasks.0.sampler.max_prompt_length + max_tokens "
        "- 1 = 12 input tokens; raise it to at least 12")
    assert "max_model_len=128 is longer than the model's max_position_embeddings=64" in found["rollout.max_model_len"]
    raw["train_worker"]["pack_max_length"] = 12  # 12 + 1 - 1 tokens fit
    assert "train_worker.pack_max_length" not in issues_of(raw)


def test_adam_betas_must_be_in_0_1(raw):
    raw["train_worker"]["optimizer"]["betas"] = [0.9, 1.0]
    assert "betas[1]=1.0 outside [0, 1)" in issues_of(raw)["train_worker.optimizer.betas"]
    raw["train_worker"]["optimizer"]["betas"] = [-0.1, 0.999]
    assert "betas[0]=-0.1" in issues_of(raw)["train_worker.optimizer.betas"]


# --------------------------------------------------------------------------- ranks and shares
def extra_task(weight):
    return {"task_name": "rare", "weight": weight, "sampler": {"name": "jsonl", "path": "data/arith.jsonl"},
            "agent_loop": {"name": "single_turn", "sample_params": {"max_tokens": 1}},
            "judger": {"name": "exact_match"}}


def test_a_task_whose_weight_rounds_to_zero_groups_is_refused(raw):
    raw["tasks"].append(extra_task(0.004))
    msg = issues_of(raw)["tasks.1.weight"]
    assert "task 'rare' gets 0 of the 100 groups of every step" in msg and "arith: 1, rare: 0.004" in msg
    raw["tasks"][1]["weight"] = 0.006  # rounds up to one group
    validate_recipe(raw, base_dir=REPO / "recipes")
    raw["tasks"][1]["weight"] = 0  # left out on purpose
    validate_recipe(raw, base_dir=REPO / "recipes")


def test_the_launch_against_the_batch(raw):
    raw["tasks"].append(extra_task(0.012))  # 1 of 100 groups on one rank; 0 of 25 on each of 4
    rec = validate_recipe(raw, base_dir=REPO / "recipes")
    assert check_launch(rec, 1) == []
    (issue,) = check_launch(rec, 4)
    assert issue.path == "tasks.1.weight" and "on each of the 4 ranks" in issue.message
    rec.trainer.train_batch_size = 3
    (issue,) = check_launch(rec, 4)
    assert issue.path == "trainer.train_batch_size" and "smaller than the 4 launched ranks" in issue.message


def test_validate_and_train_check_the_rank_count(tmp_path):
    for cmd in (["validate"], ["train", "--work-dir", str(tmp_path / "w")]):
        out = CliRunner().invoke(cli, [*cmd, str(QUICKSTART), "trainer.train_batch_size=1", "--nproc-per-node", "2"])
        assert out.exit_code == 2 and "trainer.train_batch_size" in out.output, out.output
    assert not (tmp_path / "w").exists()


# ------------------------------------------------------------------------------------ judgers
class Huge:
    name = "huge"

    def judge(self, response, label, sample):
        return {"score": 1e30} if sample.uid % 2 else -3.0


def test_an_absurd_score_fails_its_sample_with_a_warning(caplog):
    from rlcli.judgers.pool import JudgePool
    from rlcli.types import Sample, Status

    samples = [Sample(uid=i, group_id=0, task_name="t", prompt_ids=[1], response_ids=[2], response="x",
                      status=Status.COMPLETED) for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="rlcli"), JudgePool(Huge(), executor="inline") as pool:
        asyncio.run(pool.judge_group(samples))
        stats = pool.pop_stats()
    assert [s.status for s in samples] == [Status.COMPLETED, Status.FAILED] * 2
    assert samples[0].reward == {"score": -3.0} and "1e+30, beyond +-1e+06" in samples[1].error
    assert stats["judger/errors"] == 2
    warnings = [r.getMessage() for r in caplog.records if "unusable result" in r.getMessage()]
    assert len(warnings) == 1 and "'huge'" in warnings[0]
