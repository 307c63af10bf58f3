"""rlcli plugin: the ``math_verify`` judger.

Scores a response against a math label with the ``math-verify`` library: the response's answer
(a ``\\boxed{}`` expression, LaTeX, or a plain expression) is parsed and checked for mathematical
equivalence with the label, so ``\\boxed{0.5}``, ``$\\frac{1}{2}$`` and ``1/2`` all match a label
of ``\\frac{1}{2}``. Unparseable responses score ``wrong_score``; they never raise.

Parsing runs through sympy, which can take very long on adversarial input, so the judger runs in
a process pool by default (``executor: process``): a call that exceeds ``timeout_s`` is killed.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar, Literal

from pydantic import Field

from rlcli import hookimpl
from rlcli.judgers.base import Judger, JudgerConfig, require_label
from rlcli.types import Sample

__version__ = "0.1.0"
__all__ = ["MathVerifyConfig", "MathVerifyJudger", "register_judgers"]

# math-verify's own per-call limit (seconds). It relies on SIGALRM, which only works in a main
# thread; elsewhere (the thread executor) rlcli's pool enforces timeout_s instead.
_INNER_TIMEOUT_S = 5


class MathVerifyConfig(JudgerConfig):
    timeout_s: float = Field(30.0, gt=0, description="Per-call timeout; a timed-out sample is FAILED.")
    executor: Literal["inline", "thread", "process"] = Field(
        "process", description="Where judge() runs; 'process' (default) so that a hung sympy call can be killed."
    )
    correct_score: float = Field(1.0, description="Score when the response's answer is equivalent to the label.")
    wrong_score: float = Field(0.0, description="Score of a wrong or unparseable answer.")


def _gold_text(label: Any) -> str:
    text = str(label).strip()
    if "\\boxed" in text or "$" in text:
        return text
    return f"\\boxed{{{text}}}"


def _shown(parsed: list[Any]) -> str | None:
    if not parsed:
        return None
    last = parsed[-1]
    return last if isinstance(last, str) else str(last)


class MathVerifyJudger(Judger):
    """Math answers (\\boxed{}, LaTeX or plain) checked for equivalence with math-verify."""

    name: ClassVar[str] = "math_verify"
    Config: ClassVar[type[MathVerifyConfig]] = MathVerifyConfig
    config: MathVerifyConfig

    def judge(self, response: str, label: Any, sample: Sample) -> dict[str, Any]:
        from math_verify import parse, verify  # imported lazily: a heavy import, needed only in workers

        require_label(label, allow_blank=False)
        inner = _INNER_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
        gold = parse(_gold_text(label), parsing_timeout=inner)
        if not gold:
            gold = parse(str(label), parsing_timeout=inner)
        if not gold:
            raise ValueError(f"math-verify could not parse the label {label!r}")
        pred = parse(response or "", parsing_timeout=inner)
        ok = bool(pred) and verify(gold, pred, timeout_seconds=inner)
        return {
            "score": self.config.correct_score if ok else self.config.wrong_score,
            "acc": ok,
            "pred": _shown(pred),
        }

    def score_range(self) -> tuple[float, float]:
        cfg = self.config
        return (min(cfg.correct_score, cfg.wrong_score), max(cfg.correct_score, cfg.wrong_score))


@hookimpl
def register_judgers() -> list[type]:
    return [MathVerifyJudger]
