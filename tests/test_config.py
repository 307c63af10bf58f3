"""Recipe validation: every seed rule, unknown keys and names, all problems reported at once."""

import copy

import pytest
import yaml

from rlcli.config import RecipeError, load_recipe, resolved_dict, validate_recipe

from .conftest import REPO


@pytest.fixture()
def raw(repo):
    return yaml.safe_load((repo / "recipes" / "quickstart.yaml").read_text())


def issues_of(raw_data):
    with pytest.raises(RecipeError) as ei:
        validate_recipe(raw_data, source=str(REPO / "recipes" / "quickstart.yaml"))
    return {i.path: i.message for i in ei.value.issues}


def test_quickstart_resolves_every_component(repo, monkeypatch):
    monkeypatch.chdir(repo)
    rec = load_recipe(repo / "recipes" / "quickstart.yaml")
    kinds = {kind for _, kind, _ in rec.components()}
    assert {"inference_backend", "policy_loss", "advantage_estimator", "replay_buffer", "sampler",
            "agent_loop", "judger", "produce_strategy", "evaluator_metric", "tracker"} <= kinds
    for _, _, spec in rec.components():
        assert spec.cls is not None and spec.cfg is not None
    full = resolved_dict(rec)
    assert full["rollout"]["name"] == "embedded" and "max_batch_size" in full["rollout"]
    assert full["tasks"][0]["agent_loop"]["sample_params"]["max_tokens"] == 1


@pytest.mark.parametrize("key, value, path, words", [
    ("checkpoint_interval", 5, "trainer.checkpoint_interval", ["checkpoint_interval=5", "sync_weights_interval=2"]),
    ("hf_interval", 5, "trainer.hf_interval", ["hf_interval=5", "sync_weights_interval=2"]),
    ("evaluate_step", 5, "trainer.evaluate_step", ["evaluate_step=5", "sync_weights_interval=2"]),
])
def test_intervals_must_be_multiples_of_sync_interval(raw, key, value, path, words):
    raw["trainer"]["sync_weights_interval"] = 2
    raw["trainer"][key] = value
    found = issues_of(raw)
    assert path in found
    assert all(w in found[path] for w in words)


def test_intervals_disabled_and_zero(raw):
    for v in (-1, None):
        r = copy.deepcopy(raw)
        r["trainer"]["checkpoint_interval"] = v
        r["trainer"]["hf_interval"] = v
        validate_recipe(r, base_dir=REPO / "recipes")
    raw["trainer"]["checkpoint_interval"] = 0
    assert "trainer.checkpoint_interval" in issues_of(raw)


def test_steps_or_epochs_and_positivity(raw):
    del raw["trainer"]["total_train_steps"]
    assert "either trainer.total_train_steps or trainer.total_epochs" in issues_of(raw)["trainer.total_train_steps"]
    raw["trainer"]["total_epochs"] = 0
    raw["trainer"]["train_batch_size"] = -1
    raw["trainer"]["sync_weights_interval"] = 0
    found = issues_of(raw)
    assert "positive" in found["trainer.total_epochs"]
    assert "positive" in found["trainer.train_batch_size"]
    assert "positive" in found["trainer.sync_weights_interval"]


def test_eval_needs_eval_tasks(raw):
    del raw["eval"]
    assert "eval.tasks" in issues_of(raw)
    raw["trainer"]["enable_evaluate"] = False
    validate_recipe(raw, base_dir=REPO / "recipes")


def test_duplicate_task_names_and_zero_weights(raw):
    raw["tasks"].append(copy.deepcopy(raw["tasks"][0]))
    found = issues_of(raw)
    assert "duplicate task_name 'arith'" in found["tasks.1.task_name"]
    raw["tasks"].pop()
    raw["tasks"][0]["weight"] = 0
    assert "weight" in issues_of(raw)["tasks"]


def test_rollout_is_needs_the_engines_logprobs(raw):
    raw["tasks"][0]["agent_loop"]["sample_params"]["return_logprob"] = False
    validate_recipe(copy.deepcopy(raw), base_dir=REPO / "recipes")  # fine without rollout_is
    raw.setdefault("train_worker", {})["rollout_is"] = {"mode": "truncate", "threshold_upper": 2.0}
    found = issues_of(raw)
    assert "train_worker.rollout_is" in found["tasks.0.agent_loop.sample_params.return_logprob"]


def test_unknown_keys_get_did_you_mean(raw):
    raw["trainer"]["sync_weight_interval"] = 2
    raw["tasks"][0]["sampler"]["prompt_repeat"] = 8
    raw["tasks"][0]["agent_loop"]["sample_params"]["max_token"] = 3
    found = issues_of(raw)
    assert "did you mean 'sync_weights_interval'" in found["trainer.sync_weight_interval"]
    assert "did you mean 'prompt_repeat_k'" in found["tasks.0.sampler.prompt_repeat"]
    assert "did you mean 'max_tokens'" in found["tasks.0.agent_loop.sample_params.max_token"]


def test_unknown_component_names_list_available(raw):
    raw["tasks"][0]["judger"]["name"] = "gsm8kk"
    raw["rollout"]["name"] = "nope"
    found = issues_of(raw)
    assert "did you mean 'gsm8k'" in found["tasks.0.judger.name"]
    assert "available:" in found["rollout.name"] and "embedded" in found["rollout.name"]


def test_every_problem_reported_at_once(raw):
    raw["trainer"]["sync_weights_interval"] = 2
    raw["trainer"]["checkpoint_interval"] = 5
    raw["tasks"][0]["judger"]["name"] = "missing"
    raw["trainer"]["bogus"] = 1
    raw["model"]["dtype"] = "float8"
    found = issues_of(raw)
    assert {"trainer.checkpoint_interval", "tasks.0.judger.name", "trainer.bogus", "model.dtype"} <= set(found)


def test_missing_data_file_names_path(raw):
    raw["tasks"][0]["sampler"]["path"] = "nowhere/missing.jsonl"
    assert "nowhere/missing.jsonl" in issues_of(raw)["tasks.0.sampler.path"]


def test_model_path_xor_from_scratch(raw):
    raw["model"]["path"] = "/some/model"
    assert "model" in issues_of(raw)


def test_overrides_and_yaml_errors(repo, tmp_path):
    rec = load_recipe(repo / "recipes" / "quickstart.yaml", ["trainer.seed=7", "~trainer.work_dir"])
    assert rec.trainer.seed == 7 and rec.trainer.work_dir is None
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [unclosed\n")
    with pytest.raises(RecipeError, match="line"):
        load_recipe(bad)
    with pytest.raises(RecipeError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_loss_scale_factor_defaults_to_the_longest_training_response(raw, monkeypatch):
    raw["train_worker"]["loss"]["loss_agg"] = "seq-mean-token-sum-norm"
    raw["tasks"][0]["agent_loop"]["sample_params"]["max_tokens"] = 3
    raw["eval"]["tasks"][0]["agent_loop"]["sample_params"]["max_tokens"] = 9  # evaluation trains nothing
    rec = validate_recipe(copy.deepcopy(raw), base_dir=REPO / "recipes")
    assert rec.train_worker.loss.build().loss_scale_factor == 3.0
    assert resolved_dict(rec)["train_worker"]["loss"]["loss_scale_factor"] == 3.0  # fixed in resolved.yaml
    raw["train_worker"]["loss"]["loss_scale_factor"] = 512
    assert validate_recipe(copy.deepcopy(raw), base_dir=REPO / "recipes").train_worker.loss.cfg.loss_scale_factor == 512
    # an agent loop without sample_params.max_tokens leaves nothing to default to: the field is named
    del raw["train_worker"]["loss"]["loss_scale_factor"]
    monkeypatch.setattr("rlcli.config.load._task_lengths", lambda recipe: [])
    assert "set loss_scale_factor" in issues_of(raw)["train_worker.loss.loss_scale_factor"]
    # the factor belongs to that mode only
    raw["train_worker"]["loss"].update(loss_agg="token-mean", loss_scale_factor=512)
    assert any("only applies to loss_agg 'seq-mean-token-sum-norm'" in m for m in issues_of(raw).values())
