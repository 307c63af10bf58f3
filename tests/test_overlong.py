"""The ``overlong`` judger (DAPO's overlong reward shaping), the ``exclude_from_loss`` reward key,
and the DAPO recipe."""

from __future__ import annotations

import asyncio
import json
import pickle

import pytest
from click.testing import CliRunner

from rlcli.cli import cli
from rlcli.judgers import OverlongJudger
from rlcli.judgers.base import Judger, JudgerConfig
from rlcli.judgers.pool import JudgePool
from rlcli.plugins import get_registry
from rlcli.runner.sequences import sequences_from_groups
from rlcli.types import EXCLUDE_FROM_LOSS, Group, Sample, Status


class Fixed(Judger):
    """Test judger: a fixed reward, or (value None) a result that is not a score."""

    name = "fixed"

    class Config(JudgerConfig):
        value: float | None = 1.0

    def judge(self, response, label, sample):
        return "not a score" if self.config.value is None else {"score": self.config.value, "acc": True}


class AsyncFixed(Fixed):
    name = "async_fixed"

    async def judge(self, response, label, sample):
        await asyncio.sleep(0)
        return self.config.value


class Registry:
    """The built-ins plus the test judgers above."""

    def get(self, kind, name):
        test_judgers = {"fixed": Fixed, "async_fixed": AsyncFixed}
        return test_judgers[name] if kind == "judger" and name in test_judgers else get_registry().get(kind, name)


def overlong(inner=None, max_response_len=10, buffer=4, factor=2.0, **kw) -> OverlongJudger:
    cfg = OverlongJudger.Config(judger=inner or {"name": "fixed"}, max_response_len=max_response_len,
                                overlong_buffer_len=buffer, overlong_penalty_factor=factor, **kw)
    return OverlongJudger(cfg, registry=Registry())


def sample(n_tokens: int, finish_reason: str = "stop", uid: int = 0, response: str = "") -> Sample:
    return Sample(uid=uid, group_id=0, task_name="t", prompt_ids=[1, 2], response_ids=[7] * n_tokens,
                  logprobs=[-1.0] * n_tokens, response_mask=[1] * n_tokens, token_versions=[0] * n_tokens,
                  response=response, finish_reason=finish_reason, status=Status.COMPLETED)


# ------------------------------------------------------------------------------ the penalty
def test_xtuner_behaviour_51_penalty_around_gsm8k():
    """Max 8192, buffer 4096, factor 1: a 6144-token response gets -0.5 (on top of gsm8k's score)."""
    j = overlong({"name": "gsm8k"}, max_response_len=8192, buffer=4096, factor=1.0)
    right = j.judge("so #### 5", "5", sample(6144))
    assert right == {"score": 0.5, "acc": True, "pred": "5", "overlong_penalty": -0.5}
    assert j.judge("#### 4", "5", sample(6144))["score"] == -0.5
    assert j.judge("#### 5", "5", sample(4096)) == {"score": 1.0, "acc": True, "pred": "5", "overlong_penalty": 0.0}


@pytest.mark.parametrize("n_tokens, penalty", [
    (0, 0.0), (5, 0.0), (6, 0.0),  # up to L - B = 6: none
    (7, -0.5), (8, -1.0), (9, -1.5),  # -factor / B = -0.5 per token beyond
    (10, -2.0),  # L: -factor
    (12, -3.0),  # past L (only when L < max_tokens, which validate refuses): unclamped, as XTuner
])
def test_penalty_at_the_boundaries(n_tokens, penalty):
    """L 10, B 4, factor 2, inner score 1: hand-computed."""
    reward = overlong().judge("", None, sample(n_tokens))
    assert reward["overlong_penalty"] == penalty and reward["score"] == 1.0 + penalty and reward["acc"] is True


def test_zero_factor_and_a_float_result():
    assert overlong(factor=0.0).judge("", None, sample(10))["score"] == 1.0
    assert overlong(buffer=10, factor=1.0).judge("", None, sample(10))["score"] == 0.0  # B = L: from the first token


def test_the_length_is_the_sample_token_count_not_the_text():
    j = overlong()
    assert j.judge("a" * 10_000, None, sample(8))["overlong_penalty"] == -1.0
    assert j.judge("", None, sample(7, response="x"))["overlong_penalty"] == -0.5


def test_async_inner_judger_is_shaped_once_awaited():
    result = overlong({"name": "async_fixed", "value": 0.25}).judge("", None, sample(8))
    assert asyncio.run(result) == {"score": -0.75, "overlong_penalty": -1.0}


def test_an_async_inner_judger_through_the_inline_pool():
    """The inline fast path awaits what a plain judge() returns (here a wrapped async judger)."""
    pool = JudgePool(overlong({"name": "async_fixed", "value": 0.25}), executor="inline")
    s = sample(8)
    asyncio.run(pool.judge(s))
    assert s.status != Status.FAILED and s.reward == {"score": -0.75, "overlong_penalty": -1.0}


def test_an_unusable_inner_result_fails_the_sample_in_the_pool():
    pool = JudgePool(overlong({"name": "fixed", "value": None}), executor="inline")
    s = sample(8)
    asyncio.run(pool.judge(s))
    assert s.status == Status.FAILED and "not a score" in s.error and pool.pop_stats()["judger/errors"] == 1


def test_picklable_with_its_inner_judger():
    j = pickle.loads(pickle.dumps(overlong({"name": "gsm8k"}, max_response_len=8192, buffer=4096, factor=1.0)))
    assert j.judge("#### 5", "5", sample(6144))["score"] == 0.5


# ------------------------------------------------------------------------- overlong filtering
def test_exclude_truncated_marks_only_responses_cut_at_the_budget():
    j = overlong(exclude_truncated=True)
    cut = j.judge("", None, sample(10, "length"))
    assert cut == {"score": -1.0, "acc": True, "overlong_penalty": -2.0, EXCLUDE_FROM_LOSS: True}
    ended = j.judge("", None, sample(10, "stop"))  # as long, but it ended with EOS: penalised, trained on
    assert EXCLUDE_FROM_LOSS not in ended and ended["score"] == -1.0
    assert EXCLUDE_FROM_LOSS not in overlong().judge("", None, sample(10, "length"))  # off by default


def test_excluded_samples_count_in_the_advantages_but_not_in_the_loss():
    estimator = get_registry().get("advantage_estimator", "grpo")()
    scores = [1.0, 0.0, 0.0, 1.0]

    def group(excluded):
        samples = [sample(3, uid=i) for i in range(4)]
        for i, (s, score) in enumerate(zip(samples, scores)):
            s.reward = {"score": score, **({EXCLUDE_FROM_LOSS: True} if i in excluded else {})}
        return Group(group_id=0, task_name="t", samples=samples)

    _, every = sequences_from_groups([group(())], estimator)
    assert every == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-5)  # mean .5, std (n-1) .57735
    seqs, adv = sequences_from_groups([group((1, 3))], estimator)
    assert [s.seq_id for s in seqs] == [0, 2]
    assert adv == [s.advantage for s in seqs] == [every[0], every[2]]  # the baseline still holds all four
    seqs, adv = sequences_from_groups([group((0, 1, 2, 3))], estimator)
    assert seqs == [] and adv == []


def test_truncated_samples_stay_out_of_training_and_are_counted(repo, tmp_path):
    """A quickstart step whose one-token answers mostly hit max_tokens 1: every response cut off
    is left out of the loss, every other one is trained on, and metrics.jsonl counts them."""
    work = tmp_path / "run"
    judger = ("{name: overlong, executor: inline, judger: {name: exact_match}, max_response_len: 1, "
              "overlong_buffer_len: 1, overlong_penalty_factor: 0.5, exclude_truncated: true}")
    out = CliRunner().invoke(cli, ["train", str(repo / "recipes" / "quickstart.yaml"), "--work-dir", str(work),
                                   "--quiet", "trainer.total_train_steps=1", "trainer.train_batch_size=10",
                                   "trainer.enable_evaluate=false", "trainer.enable_initial_evaluate=false",
                                   f"tasks.0.judger={judger}", "~eval"])
    assert out.exit_code == 0, out.output
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    for r in rows:
        cut = round(r["response/truncated_frac"] * r["rollout/samples"])
        assert 0 < r["rollout/loss_excluded_samples"] == cut < r["rollout/samples"]
        assert r["train/sequences"] == r["rollout/samples"] - cut
        assert r["reward/max"] <= 0.5  # exact_match 1 minus the penalty 0.5 of a one-token response


# ------------------------------------------------------------------------------ validation
def test_check_config_reports_each_problem():
    cfg = OverlongJudger.Config(judger={"name": "gsm8kk", "truncated_score": 0.0}, max_response_len=8,
                                overlong_buffer_len=9, exclude_truncated=True, truncated_score=-1.0)
    issues = dict(OverlongJudger.check_config(cfg))
    assert set(issues) == {"judger.name", "overlong_buffer_len", "judger.truncated_score", "exclude_truncated"}
    assert "unknown judger 'gsm8kk'" in issues["judger.name"]
    good = OverlongJudger.Config(judger={"name": "gsm8k"}, max_response_len=8, overlong_buffer_len=8)
    assert OverlongJudger.check_config(good) == []
    with pytest.raises(ValueError, match="the inner judger needs a 'name'"):
        OverlongJudger.Config(judger={"search_last_chars": 3}, max_response_len=8, overlong_buffer_len=4)


@pytest.fixture(scope="module")
def gsm8k_data(tmp_path_factory):
    data = tmp_path_factory.mktemp("gsm8k") / "gsm8k.jsonl"
    data.write_text(json.dumps({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1?"}],
                                "reward_model": {"ground_truth": "2"}}) + "\n")
    return data


def validate(repo, model, data, *overrides):
    return CliRunner().invoke(cli, ["validate", str(repo / "recipes" / "gsm8k-dapo.yaml"), f"model.path={model}",
                                    f"tasks.0.sampler.path={data}", f"eval.tasks.0.sampler.path={data}", *overrides])


def test_the_dapo_recipe_validates_with_a_model_path(repo, tiny_llama_4k, gsm8k_data):
    out = validate(repo, tiny_llama_4k, gsm8k_data)
    assert out.exit_code == 0, out.output
    assert "tasks.0.judger: judger overlong" in out.output
    assert "tasks.0.group_filters.0: group_filter all_equal_rewards" in out.output


def test_validate_refuses_a_length_other_than_max_tokens(repo, tiny_llama_4k, gsm8k_data):
    out = validate(repo, tiny_llama_4k, gsm8k_data, "tasks.0.agent_loop.sample_params.max_tokens=512")
    assert out.exit_code == 2
    assert ("tasks.0.judger.max_response_len: 1024 differs from tasks.0.agent_loop.sample_params.max_tokens=512"
            in out.output) and "set it to 512" in out.output
    inner = "{name: overlong, judger: {name: gsm8k}, max_response_len: 100, overlong_buffer_len: 10}"
    out = validate(repo, tiny_llama_4k, gsm8k_data,  # inside a composed branch, and in an eval task
                   f"eval.tasks.0.judger={{name: composed, branches: {{openai/gsm8k: {inner}}}}}")
    assert out.exit_code == 2
    assert "eval.tasks.0.judger.branches.openai/gsm8k.max_response_len: 100 differs from " \
           "eval.tasks.0.agent_loop.sample_params.max_tokens=1024" in out.output
