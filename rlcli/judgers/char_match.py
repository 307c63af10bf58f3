"""The ``char_match`` judger: partial credit, character by character.

The score is the number of positions at which the response and the label hold the same
character, divided by the length of the longer of the two. An exact match scores 1; a response
of the right characters in the wrong places, too short or too long scores less, so a model that
gets most of a many-token answer right earns more than one that gets none of it. ``acc`` is the
exact match, which is what evaluations should count (``exact_match`` as the eval judger).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from rlcli.judgers.base import Judger, JudgerConfig, require_label
from rlcli.types import Sample


class CharMatchConfig(JudgerConfig):
    strip: bool = Field(True, description="Strip surrounding whitespace from both sides first.")
    mode: Literal["position", "prefix"] = Field(
        "position", description="position: count every position where the two agree; prefix: count only the "
        "agreeing positions before the first difference (credit for getting the answer right from its start).")


class CharMatchJudger(Judger):
    """Partial credit: the fraction of positions where response and label agree (over the longer)."""

    name: ClassVar[str] = "char_match"
    Config: ClassVar[type[CharMatchConfig]] = CharMatchConfig
    config: CharMatchConfig

    def judge(self, response: str, label: Any, sample: Sample) -> dict[str, Any]:
        text, gold = response or "", require_label(label)
        if self.config.strip:
            text, gold = text.strip(), gold.strip()
        longest = max(len(text), len(gold))
        if longest == 0:
            return {"score": 1.0, "acc": True}
        same = [a == b for a, b in zip(text, gold)]
        hits = sum(same) if self.config.mode == "position" else next(
            (i for i, ok in enumerate(same) if not ok), len(same))
        return {"score": hits / longest, "acc": text == gold}
