"""rlcli.testing.judger_conformance: it passes on every built-in judger, and each check fails on a
judger that breaks the rule it checks."""

from __future__ import annotations

import random
import threading
import time
from typing import ClassVar

import pytest

from rlcli.judgers import CharMatchJudger, ComposedJudger, ExactMatchJudger, GSM8KJudger
from rlcli.judgers.base import Judger, JudgerConfig
from rlcli.judgers.overlong import OverlongJudger
from rlcli.plugins import registry_with
from rlcli.testing import judger_conformance as jc


def composed(monkeypatch):
    monkeypatch.setenv("RLCLI_DISABLE_PLUGIN_AUTOLOAD", "1")  # built-ins only: no plugin imports
    cfg = ComposedJudger.Config(branches={"openai/gsm8k": {"name": "gsm8k", "format_score": 0.1}},
                                default={"name": "exact_match", "correct_score": 2.0})
    return ComposedJudger(cfg, registry=registry_with())


def overlong(monkeypatch):
    monkeypatch.setenv("RLCLI_DISABLE_PLUGIN_AUTOLOAD", "1")
    cfg = OverlongJudger.Config(judger={"name": "gsm8k"}, max_response_len=8, overlong_buffer_len=4,
                                overlong_penalty_factor=0.5)
    return OverlongJudger(cfg, registry=registry_with())


BUILT_INS = {
    "exact_match": (lambda mp: ExactMatchJudger(), [("4", "4"), ("4.0", "4"), ("five", "4"), ("Yes", "yes")]),
    "exact_match_scores": (lambda mp: ExactMatchJudger(ExactMatchJudger.Config(correct_score=5, wrong_score=-5)),
                           [("4", "4"), ("3", "4")]),
    "char_match": (lambda mp: CharMatchJudger(), [("1704", "1704"), ("1705", "1704"), ("17", "1704")]),
    "gsm8k": (lambda mp: GSM8KJudger(), [("so #### 72", "72"), ("#### 71", "72"), ("no answer", "72")]),
    "composed": (composed, [("#### 3", "3", {"data_source": "openai/gsm8k"}), ("#### 4", "3", {"data_source":
                 "openai/gsm8k"}), ("3", "3"), ("4", "3")]),
    "overlong": (overlong, [("so #### 72", "72"), ("#### 71", "72"), ("no answer", "72")]),
}


@pytest.mark.parametrize("name", BUILT_INS)
def test_kit_passes_on_every_built_in_judger(name, monkeypatch):
    make, cases = BUILT_INS[name]
    assert jc.run_all(make(monkeypatch), cases) == list(jc.ALL_CHECKS)


def test_declared_ranges_follow_the_config(monkeypatch):
    assert ExactMatchJudger(ExactMatchJudger.Config(correct_score=5, wrong_score=-5)).score_range() == (-5, 5)
    assert GSM8KJudger(GSM8KJudger.Config(correct_score=2, format_score=0.5)).score_range() == (0.0, 2)
    assert composed(monkeypatch).score_range() == (0.0, 2.0)
    assert overlong(monkeypatch).score_range() == (-0.5, 1.0)


# ------------------------------------------------------------------------------ broken judgers
class Broken(Judger):
    """Right answers score 1; ``bug`` breaks one rule of the contract."""

    name: ClassVar[str] = "broken"
    bug: ClassVar[str] = ""

    def __init__(self, config=None):
        super().__init__(config or JudgerConfig(timeout_s=0.2))
        self.lock = threading.Lock()  # unpicklable, for the "process" bug

    def judge(self, response, label, sample):
        if self.bug == "nan" and response == "x":
            return float("nan")
        if self.bug == "range" and response == label:
            return 2.0
        if self.bug == "garbage" and not response.strip():
            raise ValueError("empty response")
        if self.bug == "random":
            return random.random()
        if self.bug == "slow" and len(response) > 1000:
            time.sleep(0.5)
        return float(response == label)

    def __getstate__(self):
        if self.bug == "process":
            raise TypeError("cannot pickle '_thread.lock' object")
        return {k: v for k, v in self.__dict__.items() if k != "lock"}


def broken(bug, **config):
    cls = type(f"Broken_{bug}", (Broken,), {"bug": bug})  # made here, so not picklable by reference:
    return cls(JudgerConfig(**{"timeout_s": 0.2, "executor": "thread", **config}))  # thread, unless a case says


CASES = [("1", "1"), ("2", "1"), ("x", "1")]


@pytest.mark.parametrize("bug, check, message", [
    ("nan", "scores_in_range", "judger returned a non-finite score nan"),
    ("range", "scores_in_range", r"scored 2.0, outside its score_range\(\) \(0.0, 1.0\)"),
    ("garbage", "garbage_handled", "raised ValueError: empty response. A response the judger cannot read"),
    ("random", "deterministic", "over 3 calls"),
    ("process", "deterministic", "cannot be pickled .* but its executor is 'process'"),
    ("slow", "respects_timeout", "ran longer than timeout_s=0.2s"),
])
def test_each_check_fails_on_the_judger_that_breaks_its_rule(bug, check, message):
    judger = broken(bug, **({"executor": "process"} if bug == "process" else {}))
    with pytest.raises(AssertionError, match=message):
        jc.ALL_CHECKS[check](judger, CASES)
    assert jc.run_all(broken(""), CASES) == list(jc.ALL_CHECKS)  # the same judger without the bug passes
