"""The ``exact_match`` judger and the exact numeric comparison shared by the rule judgers.

Numbers are compared as exact rationals (:class:`fractions.Fraction`), never as floats: "72.0",
"72" and "72." are the same number, "1,000" is 1000, "$5" is 5, and "0.1 + 0.2 == 0.3" holds.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any, ClassVar

from pydantic import Field

from rlcli.judgers.base import Judger, JudgerConfig, require_label
from rlcli.types import Sample

# A plain decimal (optionally signed, with an optional decimal point) or an integer ratio "a/b".
_DECIMAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)")
_RATIO = re.compile(r"([+-]?\d+)/(\d+)")


def parse_number(text: Any) -> Fraction | None:
    """Parse ``text`` as an exact number, or return None when it is not one.

    Accepted: ints, finite floats (through their shortest repr, so ``0.1`` is 1/10), and strings
    holding a decimal such as ``"-1,234.50"``, ``"$5"``, ``"72."`` or ``".5"``, or an integer
    ratio such as ``"3/4"``. Thousands separators, ``$`` signs, surrounding whitespace and one
    trailing full stop are ignored. Anything else (words, ``"1.2.3"``, ``"inf"``) is None.
    """
    if isinstance(text, bool):
        return None
    if isinstance(text, int):
        return Fraction(text)
    if isinstance(text, float):
        return Fraction(repr(text)) if math.isfinite(text) else None
    if isinstance(text, Fraction):
        return text
    if not isinstance(text, str):
        return None
    s = text.strip().replace(",", "").replace("$", "")
    if s.endswith(".") and s.count(".") > 1:
        s = s[:-1]  # "7.5." -> "7.5" (a sentence-ending full stop after a decimal)
    if _DECIMAL.fullmatch(s):
        return Fraction(s.rstrip("."))
    m = _RATIO.fullmatch(s)
    if m and int(m.group(2)) != 0:
        return Fraction(int(m.group(1)), int(m.group(2)))
    return None


def canonical_number(value: Fraction) -> str:
    """A canonical text for an exact number: ``"72"``, ``"-0.5"``, ``"1/3"`` (non-terminating)."""
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    twos = fives = 0
    while den % 2 == 0:
        den //= 2
        twos += 1
    while den % 5 == 0:
        den //= 5
        fives += 1
    if den != 1:  # not a terminating decimal
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    scaled = abs(value) * 10**places
    digits = str(scaled.numerator).rjust(places + 1, "0")
    sign = "-" if value < 0 else ""
    return f"{sign}{digits[:-places]}.{digits[-places:]}"


class ExactMatchConfig(JudgerConfig):
    first_word_only: bool = Field(
        False, description="Compare only the response text up to its first whitespace or newline."
    )
    normalize_numbers: bool = Field(
        True, description="Compare as exact numbers when both sides are numbers ('7.0' == '7', '1,000' == '1000')."
    )
    case_sensitive: bool = Field(True, description="When false, compare non-numeric answers case-insensitively.")
    correct_score: float = Field(1.0, description="Score of a matching response.")
    wrong_score: float = Field(0.0, description="Score of any other response.")


class ExactMatchJudger(Judger):
    """Scores 1 when the stripped response equals the label (optionally as numbers), else 0."""

    name: ClassVar[str] = "exact_match"
    Config: ClassVar[type[ExactMatchConfig]] = ExactMatchConfig
    config: ExactMatchConfig

    def judge(self, response: str, label: Any, sample: Sample) -> dict[str, Any]:
        require_label(label)
        cfg = self.config
        text = (response or "").strip()
        if cfg.first_word_only:
            text = text.split(maxsplit=1)[0] if text else ""
        gold = str(label).strip()
        if cfg.normalize_numbers and (a := parse_number(text)) is not None and (b := parse_number(gold)) is not None:
            ok = a == b
        elif cfg.case_sensitive:
            ok = text == gold
        else:
            ok = text.casefold() == gold.casefold()
        return {"score": cfg.correct_score if ok else cfg.wrong_score, "acc": ok}

    def score_range(self) -> tuple[float, float]:
        cfg = self.config
        return (min(cfg.correct_score, cfg.wrong_score), max(cfg.correct_score, cfg.wrong_score))
