"""The math_verify judger: equivalence scoring, garbage input, registration, and the process pool."""

from __future__ import annotations

import asyncio
import importlib.metadata as md
import pickle

import pytest

from rlcli.judging import JudgePool
from rlcli.types import Sample, Status
from rlcli_math_verify import MathVerifyConfig, MathVerifyJudger


def sample(response: str, label: object, uid: int = 0) -> Sample:
    return Sample(uid=uid, group_id=0, task_name="math", prompt_ids=[1], response=response, label=label,
                  data_source="math", status=Status.COMPLETED)


@pytest.fixture(scope="module")
def judger() -> MathVerifyJudger:
    return MathVerifyJudger()


def score(judger: MathVerifyJudger, response: str, label: object) -> dict:
    return judger.judge(response, label, sample(response, label))


@pytest.mark.parametrize(
    "response, label",
    [
        ("The answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("So we get \\boxed{0.5}", "\\frac{1}{2}"),  # \frac{1}{2} vs 0.5
        ("Therefore $\\frac{1}{2}$", "0.5"),
        ("\\boxed{\\frac{3}{4}}", "3/4"),  # boxed fraction vs a plain ratio
        ("\\boxed{1+x^2}", "x^2+1"),
        ("The result is 7", 7),  # a numeric label
    ],
)
def test_equivalent_answers_score_correct(judger, response, label):
    out = score(judger, response, label)
    assert out["score"] == 1.0 and out["acc"] is True and out["pred"]


@pytest.mark.parametrize(
    "response, label",
    [
        ("\\boxed{\\frac{1}{3}}", "0.5"),
        ("\\boxed{41}", "42"),
        ("\\boxed{x^2-1}", "x^2+1"),
        ("Either \\boxed{2} or \\boxed{42}", "42"),  # hedging: several boxed answers form a set {2, 42}
    ],
)
def test_wrong_answers_score_wrong(judger, response, label):
    out = score(judger, response, label)
    assert out["score"] == 0.0 and out["acc"] is False


@pytest.mark.parametrize("response", ["", "no math here at all", "\\boxed{", "))((\\frac{}{", "$$$$", "\x00\x01"])
def test_garbage_scores_zero_without_raising(judger, response):
    out = score(judger, response, "\\frac{1}{2}")
    assert out["score"] == 0.0 and out["acc"] is False


def test_scores_are_configurable():
    j = MathVerifyJudger(MathVerifyConfig(correct_score=2.0, wrong_score=-1.0))
    assert score(j, "\\boxed{2}", "2")["score"] == 2.0
    assert score(j, "\\boxed{3}", "2")["score"] == -1.0


def test_missing_or_unparseable_label_is_an_error(judger):
    with pytest.raises(ValueError, match="no label"):
        score(judger, "\\boxed{1}", None)
    with pytest.raises(ValueError, match="could not parse the label"):
        score(judger, "\\boxed{1}", "}}}")


def test_config_defaults_and_validation():
    cfg = MathVerifyConfig()
    assert (cfg.timeout_s, cfg.executor, cfg.correct_score, cfg.wrong_score) == (30.0, "process", 1.0, 0.0)
    with pytest.raises(Exception):
        MathVerifyConfig(bogus=1)
    for name, field in MathVerifyConfig.model_fields.items():
        assert field.description, name
    assert MathVerifyJudger.__doc__.strip().splitlines()[0]


def test_picklable(judger):
    clone = pickle.loads(pickle.dumps(judger))
    assert score(clone, "\\boxed{2}", "2")["acc"] is True


def test_registered_through_the_entry_point():
    eps = [ep for ep in md.entry_points(group="rlcli") if ep.name == "math_verify"]
    assert eps and eps[0].value == "rlcli_math_verify" and eps[0].dist.version == "0.1.0"
    from rlcli.plugins import get_registry

    entry = get_registry(refresh=True).entry("judger", "math_verify")
    assert entry.cls is MathVerifyJudger
    assert (entry.dist, entry.version) == ("rlcli-math-verify", "0.1.0")


def test_runs_in_the_process_pool_and_garbage_never_crashes():
    pool = JudgePool(MathVerifyJudger(MathVerifyConfig(timeout_s=30)), workers=2)
    assert pool.executor == "process"
    try:
        samples = [sample("\\boxed{\\frac{1}{2}}", "0.5", 0), sample("\\boxed{", "0.5", 1),
                   sample("\\boxed{7}", "0.5", 2), sample("x", None, 3)]
        asyncio.run(pool.judge_group(samples))
        assert [s.score for s in samples[:3]] == [1.0, 0.0, 0.0]
        assert all(s.status == Status.COMPLETED for s in samples[:3])
        assert samples[3].status == Status.FAILED and "no label" in samples[3].error
    finally:
        pool.close()


def test_keeps_the_judger_contract():
    from rlcli.testing import judger_conformance as jc

    cases = [("\\boxed{\\frac{1}{2}}", "0.5"), ("Therefore $\\frac{1}{2}$", "0.5"), ("\\boxed{3}", "2"), ("7", 7)]
    assert jc.run_all(MathVerifyJudger(), cases) == list(jc.ALL_CHECKS)
    assert MathVerifyJudger(MathVerifyConfig(correct_score=2.0, wrong_score=-1.0)).score_range() == (-1.0, 2.0)
