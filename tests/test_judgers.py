"""Built-in judgers: gsm8k, exact_match, composed; numeric normalisation; registration and validation."""

from __future__ import annotations

import pickle
from fractions import Fraction

import pytest
from pydantic import ValidationError

from rlcli.judgers import CharMatchJudger, ComposedJudger, ExactMatchJudger, GSM8KJudger
from rlcli.judgers.base import Judger, JudgerConfig
from rlcli.judgers.exact_match import canonical_number, parse_number
from rlcli.judgers.gsm8k import extract_answer
from rlcli.plugins import get_registry
from rlcli.types import Sample, Status


def sample(response: str = "", label: object = None, data_source: str = "") -> Sample:
    return Sample(uid=0, group_id=0, task_name="t", prompt_ids=[1], response=response, label=label,
                  data_source=data_source, status=Status.COMPLETED)


def judge(judger: Judger, response: str, label: object, data_source: str = "") -> dict:
    return judger.judge(response, label, sample(response, label, data_source))


# ------------------------------------------------------------------------------- numbers
@pytest.mark.parametrize(
    "text, value",
    [("72", 72), ("72.0", 72), ("72.", 72), ("1,000", 1000), ("$5", 5), ("-$5", -5), (" -0.50 ", Fraction(-1, 2)),
     (".5", Fraction(1, 2)), ("+3", 3), ("3/4", Fraction(3, 4)), ("7.5.", Fraction(15, 2)), (7, 7), (0.1, Fraction(1, 10)),
     (2.50, Fraction(5, 2))],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("text", ["", "abc", "1.2.3", "inf", "nan", "1e3", "1_000", "3/0", "- 5", "72 apples",
                                  None, True, float("nan"), float("inf"), [1]])
def test_parse_number_rejects(text):
    assert parse_number(text) is None


def test_parse_number_is_exact_not_float():
    assert parse_number("0.1") + parse_number("0.2") == parse_number("0.3")
    assert parse_number("1.0000000000000001") != parse_number("1")  # equal as floats, not as numbers


@pytest.mark.parametrize("value, text", [(Fraction(72), "72"), (Fraction(-1, 2), "-0.5"), (Fraction(1, 3), "1/3"),
                                         (Fraction(1, 8), "0.125"), (Fraction(-1001, 100), "-10.01")])
def test_canonical_number(value, text):
    assert canonical_number(value) == text
    assert parse_number(text) == value


# --------------------------------------------------------------------------------- gsm8k
def test_gsm8k_xtuner_behaviour_50_with_numeric_fix():
    j = GSM8KJudger()
    assert judge(j, "She has 9 eggs ... so #### 72", "72") == {"score": 1.0, "acc": True, "pred": "72"}
    assert judge(j, "#### 1,000", "1000")["score"] == 1.0
    # XTuner scores "#### 72.0" vs "72" as 0 (string compare); we compare exact numbers
    assert judge(j, "#### 72.0", "72")["score"] == 1.0
    assert judge(j, "the answer is 72", "72") == {"score": 0.0, "acc": False, "pred": None}
    # only the last 300 characters are searched
    assert judge(j, "#### 72" + " filler" * 50, "72")["score"] == 0.0
    assert judge(j, "x" * 1000 + " #### 72", "72")["score"] == 1.0
    # the last match wins
    assert judge(j, "#### 5\n... on reflection\n#### 72", "72")["score"] == 1.0
    assert judge(j, "#### 72\n... on reflection\n#### 5", "72")["pred"] == "5"


@pytest.mark.parametrize(
    "response, label",
    [("#### $5", "5"), ("#### 72.", "72"), ("#### 1,000.00", "1000"), ("#### -3", "-3"), ("#### 0.50", ".5"),
     ("#### 72", 72), ("#### 2.5", 2.5), ("#### 1200", "1,200"), ("#### $1,234.5", "$1234.50")],
)
def test_gsm8k_numeric_normalisation(response, label):
    assert judge(GSM8KJudger(), response, label)["acc"] is True


def test_gsm8k_scores_and_format_score():
    j = GSM8KJudger(GSM8KJudger.Config(correct_score=2.0, format_score=0.1))
    assert judge(j, "#### 72", "72")["score"] == 2.0
    assert judge(j, "#### 71", "72") == {"score": 0.1, "acc": False, "pred": "71"}
    assert judge(j, "no answer", "72")["score"] == 0.0  # not well-formed: 0, not format_score
    assert judge(j, "#### $", "72")["score"] == 0.0
    assert judge(j, "####72", "72")["score"] == 0.0  # the rule needs "#### " with a space


def test_gsm8k_non_numeric_capture_falls_back_to_strings():
    assert judge(GSM8KJudger(), "#### 1.2.3", "1.2.3")["acc"] is True
    assert judge(GSM8KJudger(), "#### 1.2.3", "1.2")["acc"] is False


def test_gsm8k_search_window_config():
    long = "#### 72" + " x" * 250
    assert judge(GSM8KJudger(GSM8KJudger.Config(search_last_chars=0)), long, "72")["acc"] is True
    assert judge(GSM8KJudger(GSM8KJudger.Config(search_last_chars=10)), long, "72")["acc"] is False
    assert extract_answer("#### 7 and then #### 8", 0) == "8"
    assert extract_answer("nothing") is None


def test_gsm8k_missing_label_raises():
    with pytest.raises(ValueError, match="no label"):
        judge(GSM8KJudger(), "#### 7", None)
    with pytest.raises(ValueError, match="no label"):
        judge(GSM8KJudger(), "#### 7", "  ")


def test_gsm8k_on_real_answers(tmp_path):
    import json
    from pathlib import Path

    raw = Path(__file__).resolve().parent / "data" / "gsm8k" / "test.jsonl"  # 42 rows of the test split (MIT)
    j = GSM8KJudger()
    lines = raw.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 42
    for line in lines:
        rec = json.loads(line)
        truth = rec["answer"].rsplit("####", 1)[1].strip()
        # the reference solution itself ends with "#### n" and must score as correct
        assert judge(j, rec["answer"], truth.replace(",", ""))["acc"] is True


# --------------------------------------------------------------------------- exact_match
def test_exact_match():
    j = ExactMatchJudger()
    assert judge(j, "7", "7") == {"score": 1.0, "acc": True}
    assert judge(j, "  7\n", 7)["score"] == 1.0
    assert judge(j, "7.0", 7)["score"] == 1.0  # numeric normalisation (default on)
    assert judge(j, "8", "7")["score"] == 0.0
    assert judge(j, "7 because 3+4", "7")["score"] == 0.0
    assert judge(j, "", "7")["score"] == 0.0
    assert judge(j, "Paris", "paris")["score"] == 0.0


def test_char_match_gives_partial_credit_by_position():
    j = CharMatchJudger()
    assert judge(j, "4321", "4321") == {"score": 1.0, "acc": True}
    assert judge(j, " 4321\n", "4321")["acc"] is True  # stripped by default
    assert judge(j, "4301", "4321") == {"score": 0.75, "acc": False}
    assert judge(j, "43", "4321")["score"] == 0.5  # too short: over the longer of the two
    assert judge(j, "432100", "4321")["score"] == pytest.approx(4 / 6)  # too long
    assert judge(j, "1234", "4321")["score"] == 0.0  # right characters, wrong places
    assert judge(j, "", "4321")["score"] == 0.0
    assert judge(j, "", "")["score"] == 1.0
    raw = CharMatchJudger(CharMatchJudger.Config(strip=False))
    assert judge(raw, " 4321", "4321")["score"] == 0.0
    prefix = CharMatchJudger(CharMatchJudger.Config(mode="prefix"))  # only what is right from the start counts
    assert judge(prefix, "4321", "4321") == {"score": 1.0, "acc": True}
    assert judge(prefix, "4301", "4321")["score"] == 0.5
    assert judge(prefix, "0321", "4321")["score"] == 0.0
    assert judge(prefix, "43210", "4321")["score"] == pytest.approx(4 / 5)
    assert judge(prefix, "", "4321")["score"] == 0.0
    with pytest.raises(ValueError, match="no label"):
        judge(j, "1", None)


def test_exact_match_options():
    first = ExactMatchJudger(ExactMatchJudger.Config(first_word_only=True))
    assert judge(first, "7 because 3+4", "7")["score"] == 1.0
    assert judge(first, "7\n8", "7")["score"] == 1.0
    assert judge(first, "   ", "7")["score"] == 0.0
    strict = ExactMatchJudger(ExactMatchJudger.Config(normalize_numbers=False))
    assert judge(strict, "7.0", "7")["score"] == 0.0
    nocase = ExactMatchJudger(ExactMatchJudger.Config(case_sensitive=False, correct_score=1.0, wrong_score=-1.0))
    assert judge(nocase, "PARIS", "paris")["score"] == 1.0
    assert judge(nocase, "Rome", "paris")["score"] == -1.0
    with pytest.raises(ValueError, match="no label"):
        judge(ExactMatchJudger(), "7", None)


# ------------------------------------------------------------------------------ composed
class FixedJudger(Judger):
    """Test judger returning a fixed reward."""

    name = "fixed"

    class Config(JudgerConfig):
        value: float = 0.0

    def judge(self, response, label, sample):
        return {"score": self.config.value, "branch": f"fixed-{self.config.value}"}


class FakeRegistry:
    """The registry surface the composed judger uses, with the built-ins plus FixedJudger."""

    def __init__(self):
        self._real = get_registry()

    def get(self, kind, name):
        if (kind, name) == ("judger", "fixed"):
            return FixedJudger
        return self._real.get(kind, name)


def composed(branches, default=None, registry=None) -> ComposedJudger:
    cfg = ComposedJudger.Config(branches=branches, default=default)
    return ComposedJudger(cfg, registry=registry or get_registry())


def test_composed_routes_by_data_source_and_passes_rewards_through():
    """XTuner behaviour 52 (adapted)."""
    j = composed({"correctness": {"name": "fixed", "value": 0.7}, "openai/gsm8k": {"name": "gsm8k"}},
                 registry=FakeRegistry())
    assert judge(j, "x", "y", "correctness") == {"score": 0.7, "branch": "fixed-0.7"}
    assert judge(j, "#### 72.0", "72", "openai/gsm8k") == {"score": 1.0, "acc": True, "pred": "72.0"}
    with pytest.raises(ValueError, match="needs sample.data_source"):
        judge(j, "x", "y", "")
    with pytest.raises(ValueError) as err:
        judge(j, "x", "y", "unknown/source")
    assert "'unknown/source'" in str(err.value) and "correctness, openai/gsm8k" in str(err.value)


def test_composed_default_branch():
    j = composed({"openai/gsm8k": {"name": "gsm8k"}}, default={"name": "exact_match"})
    assert judge(j, "7", "7", "toy")["score"] == 1.0
    assert judge(j, "7", "7", "")["score"] == 1.0
    only_default = composed({}, default={"name": "exact_match", "first_word_only": True})
    assert judge(only_default, "7 yes", "7", "any")["score"] == 1.0


def test_composed_builds_lazily_once():
    j = composed({"a": {"name": "exact_match"}})
    assert j._branches is None
    judge(j, "1", "1", "a")
    built = j.branch_for("a")
    judge(j, "1", "1", "a")
    assert j.branch_for("a") is built and isinstance(built, ExactMatchJudger)


def test_composed_is_picklable_and_carries_built_branches():
    j = composed({"a": {"name": "exact_match", "first_word_only": True}, "b": {"name": "gsm8k"}})
    clone = pickle.loads(pickle.dumps(j))
    assert clone._registry is None and clone._branches is not None  # no registry needed in a worker
    assert judge(clone, "7 and more", "7", "a")["score"] == 1.0
    assert judge(clone, "#### 7", "7", "b")["score"] == 1.0
    assert pickle.loads(pickle.dumps(clone)).branch_for("b").config.search_last_chars == 300


def test_composed_config_structure_errors():
    with pytest.raises(ValidationError, match="needs a 'name'"):
        ComposedJudger.Config(branches={"a": {"first_word_only": True}})
    with pytest.raises(ValidationError):
        ComposedJudger.Config(branches={"a": "gsm8k"})
    with pytest.raises(ValidationError):
        ComposedJudger.Config(branchez={})


def test_composed_check_config_reports_every_problem():
    cfg = ComposedJudger.Config(
        branches={
            "a": {"name": "gsm8kk"},
            "b": {"name": "exact_match", "first_word": True},
            "c": {"name": "gsm8k", "search_last_chars": -1},
            "d": {"name": "composed", "branches": {"x": {"name": "nope"}}},
            "ok": {"name": "exact_match"},
        },
        default={"name": "missing"},
    )
    issues = dict(ComposedJudger.check_config(cfg))
    assert "unknown judger 'gsm8kk'" in issues["branches.a.name"] and "did you mean 'gsm8k'" in issues["branches.a.name"]
    assert "available: char_match, composed, exact_match, gsm8k" in issues["branches.a.name"]
    assert "unknown key" in issues["branches.b.first_word"] and "first_word_only" in issues["branches.b.first_word"]
    assert "greater than or equal to 0" in issues["branches.c.search_last_chars"]
    assert "unknown judger 'nope'" in issues["branches.d.branches.x.name"]
    assert "unknown judger 'missing'" in issues["default.name"]
    assert not any(k.startswith("branches.ok") for k in issues)
    assert ComposedJudger.check_config(ComposedJudger.Config()) == [
        ("branches", "must contain at least one judger branch (or set 'default')")
    ]
    good = ComposedJudger.Config(branches={"openai/gsm8k": {"name": "gsm8k"}})
    assert ComposedJudger.check_config(good) == []


def test_composed_validated_by_the_recipe_validator():
    from rlcli.config import _resolve_component

    issues: list = []
    raw = {"name": "composed", "branches": {"openai/gsm8k": {"name": "gsm8c"}}}
    _resolve_component(get_registry(), ("tasks", 0, "judger"), "judger", raw, issues)
    assert [i.path for i in issues] == ["tasks.0.judger.branches.openai/gsm8k.name"]
    assert "unknown judger 'gsm8c'" in issues[0].message


# -------------------------------------------------------------------------- registration
def test_builtin_judgers_are_registered_with_full_metadata():
    reg = get_registry()
    for name, cls in (("gsm8k", GSM8KJudger), ("exact_match", ExactMatchJudger), ("composed", ComposedJudger)):
        entry = reg.entry("judger", name)
        assert entry.cls is cls and entry.dist == "rlcli"
        assert entry.description and "\n" not in entry.description
        assert issubclass(cls.Config, JudgerConfig)
        for field_name, field in cls.Config.model_fields.items():
            assert field.description, f"{name}.{field_name} has no description"
        with pytest.raises(ValidationError):
            cls.Config(unknown_key=1)
        assert pickle.loads(pickle.dumps(cls())).config == cls().config
