"""The ``gsm8k`` judger: the final answer after ``####``, compared as an exact number.

Rule (XTuner's GSM8K judger, with two differences): search only the last ``search_last_chars``
characters of the response for ``#### <number>``; when there are several, the **last** one wins;
``,`` is stripped. The differences:

- ``$`` is part of the answer pattern here and stripped: "#### $5" reads 5. XTuner's pattern,
  ``#### (-?[0-9.,]+)``, has no ``$``, so there "#### $5" is no answer (score 0), and the ``$``
  it strips from a capture is never in one.
- Prediction and label are compared as exact numbers, where XTuner compares strings ("#### 72.0"
  against "72" scores 0 there): "72.0" == "72", "1,000" == "1000", "$5" == "5", "72." == "72".
  A non-numeric capture (e.g. "1.2.3") falls back to string equality.

Scores: correct → ``correct_score``; a well-formed but wrong answer → ``format_score``; no
``####`` answer at all → 0.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import Field

from rlcli.judgers.base import Judger, JudgerConfig, require_label
from rlcli.judgers.exact_match import canonical_number, parse_number
from rlcli.types import Sample

ANSWER_RE = re.compile(r"#### (-?[0-9.,$]+)")


def extract_answer(response: str, search_last_chars: int = 300) -> str | None:
    """The answer after the last ``#### `` in the tail of ``response`` (``,``/``$`` removed), or None."""
    tail = response[-search_last_chars:] if search_last_chars > 0 else response
    matches = ANSWER_RE.findall(tail)
    if not matches:
        return None
    answer = matches[-1].replace(",", "").replace("$", "")
    if not any(ch.isdigit() for ch in answer):
        return None  # "#### $" or "#### ..." carries no number
    if answer.endswith("."):
        answer = answer[:-1]  # a sentence-ending full stop: "#### 72."
    return answer


def _normalized(text: Any) -> str:
    value = parse_number(text)
    return canonical_number(value) if value is not None else str(text).strip().replace(",", "").replace("$", "")


class GSM8KConfig(JudgerConfig):
    correct_score: float = Field(1.0, description="Score when the '####' answer equals the label.")
    format_score: float = Field(0.0, description="Score of a well-formed '####' answer that is wrong.")
    search_last_chars: int = Field(
        300, ge=0, description="Search only this many trailing characters of the response (0 = all of it)."
    )


class GSM8KJudger(Judger):
    """GSM8K: the last '#### <number>' (also '#### $<number>', unlike XTuner) equals the label as an exact number."""

    name: ClassVar[str] = "gsm8k"
    Config: ClassVar[type[GSM8KConfig]] = GSM8KConfig
    config: GSM8KConfig

    def judge(self, response: str, label: Any, sample: Sample) -> dict[str, Any]:
        require_label(label, allow_blank=not isinstance(label, str))
        pred = extract_answer(response or "", self.config.search_last_chars)
        if pred is None:
            return {"score": 0.0, "acc": False, "pred": None}
        ok = _normalized(pred) == _normalized(label)
        return {"score": self.config.correct_score if ok else self.config.format_score, "acc": ok, "pred": pred}

    def score_range(self) -> tuple[float, float]:
        cfg = self.config
        return (min(cfg.correct_score, cfg.format_score, 0.0), max(cfg.correct_score, cfg.format_score, 0.0))
