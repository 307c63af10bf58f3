"""The files ``rlcli new judger NAME`` fills in: a judger, its tests (with the judger kit), its recipe."""

from __future__ import annotations

from rlcli.scaffold.templates import KindTemplate

MODULE = '''\
"""rlcli plugin: the ``{{name}}`` judger.

Written by ``rlcli new judger {{name}}`` as a starting point: it scores ``correct_score`` when the
last number in the response equals the label, else ``wrong_score``. Change ``judge`` (and the
options of ``{{Cls}}Config``) to score what you need, and keep the contract every judger keeps
(the docstring of ``rlcli.judgers.base.Judger``; rlcli's docs/writing-plugins.md):

* ``judge(response, label, sample)`` returns a float, or a dict with a float ``"score"`` (its
  other keys are logged, e.g. ``"acc"``), for *any* response: one it cannot read (empty, garbage,
  huge) gets the lowest score, not an exception (an exception fails the sample, which then
  teaches the model nothing);
* every score lies within ``score_range()``;
* the same input gets the same score, also from a pickled copy (the default ``executor:
  process`` runs ``judge`` in worker processes);
* it returns within ``config.timeout_s``.

``tests/test_{{name}}.py`` checks all four with ``rlcli.testing.judger_conformance``.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import Field

from rlcli import hookimpl
from rlcli.judgers.base import Judger, JudgerConfig, require_label
from rlcli.types import Sample

__version__ = "0.1.0"
__all__ = ["{{Class}}", "{{Cls}}Config", "register_judgers"]

NUMBER = re.compile(r"-?[0-9]+(?:[.][0-9]+)?")
TAIL_CHARS = 200  # read only the end of a response: bounded work on one that never stopped


class {{Cls}}Config(JudgerConfig):
    """The recipe options of the judger (``timeout_s``, ``executor``, ... come from ``JudgerConfig``)."""

    correct_score: float = Field(1.0, description="Score of a response whose last number equals the label.")
    wrong_score: float = Field(0.0, description="Score of any other response, unreadable ones included.")


class {{Class}}(Judger):
    """Scores correct_score when the response's last number equals the label, else wrong_score."""

    name: ClassVar[str] = "{{name}}"  # what recipes write: judger: {name: {{name}}}
    Config: ClassVar[type[{{Cls}}Config]] = {{Cls}}Config
    config: {{Cls}}Config

    def judge(self, response: str, label: Any, sample: Sample) -> dict[str, Any]:
        gold = require_label(label, allow_blank=False).strip()  # no label: the sample FAILS, saying why
        numbers = NUMBER.findall(response[-TAIL_CHARS:])
        correct = bool(numbers) and numbers[-1] == gold
        return {"score": self.config.correct_score if correct else self.config.wrong_score, "acc": correct}

    def score_range(self) -> tuple[float, float]:
        """The lowest and highest score ``judge`` returns with this config."""
        low, high = sorted((self.config.correct_score, self.config.wrong_score))
        return low, high


@hookimpl
def register_judgers() -> list[type]:
    return [{{Class}}]
'''

TESTS = '''\
"""Tests of the {{name}} judger: what it scores, the judger contract (rlcli's kit), its entry point."""

import pytest

from rlcli.plugins import get_registry
from rlcli.testing import judger_conformance
from rlcli.types import Sample

from {{module}} import {{Class}}, {{Cls}}Config

# (response, label): right and wrong answers, for the kit
CASES = [("7", "7"), ("so 3+4 is 7", "7"), ("12", "12"), ("3", "7"), ("7 or 8", "7"), ("x", "7")]


def score(judger, response, label="7"):
    return judger.judge(response, label, Sample(uid=0, group_id=0, task_name="test", prompt_ids=[1]))["score"]


def test_scores_the_last_number():
    judger = {{Class}}()
    assert score(judger, "7") == score(judger, "so 3+4 is 7") == 1.0
    assert score(judger, "8") == score(judger, "7 or 8") == score(judger, "") == 0.0


def test_scores_and_range_are_configurable():
    judger = {{Class}}({{Cls}}Config(correct_score=2.0, wrong_score=-1.0))
    assert (score(judger, "7"), score(judger, "1")) == (2.0, -1.0)
    assert judger.score_range() == (-1.0, 2.0)


def test_a_missing_label_is_an_error():
    with pytest.raises(ValueError, match="no label"):
        score({{Class}}(), "7", label=None)


def test_keeps_the_judger_contract():
    checks = judger_conformance.run_all({{Class}}(), CASES)
    assert checks == list(judger_conformance.ALL_CHECKS)


def test_rlcli_finds_it_once_installed():
    """Passes once the package is installed (pip install -e .): the entry point in pyproject.toml."""
    entry = get_registry(refresh=True).entry("judger", "{{name}}")
    assert entry.cls is {{Class}} and entry.dist == "{{dist}}"
'''

RECIPE_TASK = '''\
    agent_loop:
      name: single_turn
      sample_params: {max_tokens: 1, temperature: 1.0}
    judger: {name: {{name}}, correct_score: 1.0, wrong_score: 0.0, executor: inline}  # inline: a cheap judger'''

RECIPE_EVAL_TASK = '''\
      agent_loop:
        name: single_turn
        sample_params: {max_tokens: 1, temperature: 0.0}
      judger: {name: {{name}}, executor: inline}'''

README_YAML = '''\
    judger:
      name: {{name}}
      correct_score: 1.0     # the last number of the response equals the label
      wrong_score: 0.0       # anything else
      timeout_s: 30          # per call; a slower call fails its sample, the run goes on
      executor: process      # default: calls run in worker processes (inline: in the event loop)'''

README_TEXT = '''\
The label is `reward_model.ground_truth` of each data row. `judge` returns
`{"score": float, "acc": bool}`; `rlcli validate` checks the options above before any model loads.'''

TEMPLATE = KindTemplate(
    title="judger", registry_kind="judger", hook="register_judgers", class_suffix="Judger", module=MODULE,
    tests=TESTS, tokenizer="builtin:digits", recipe_task=RECIPE_TASK, recipe_eval_task=RECIPE_EVAL_TASK,
    readme_yaml=README_YAML, readme_text=README_TEXT,
)
