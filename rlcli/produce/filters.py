"""Group filters: drop COMPLETED groups before they reach training.

A filter's ``keep(group) -> bool`` sees a judged group; a dropped group is counted as FILTERED
and replaced by a fresh prompt (it is never trained on). This replaces XTuner's
``is_valid_sample_fn`` callable with registered, configurable components.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from rlcli import hookimpl
from rlcli.component import Component, ComponentConfig
from rlcli.types import Group, Status


class GroupFilter(Component):
    """Base class of group filters."""

    def keep(self, group: Group) -> bool:
        raise NotImplementedError


class AllEqualRewardsConfig(ComponentConfig):
    tolerance: float = Field(0.0, ge=0, description="Rewards closer than this count as equal.")


class AllEqualRewards(GroupFilter):
    """DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage, no signal)."""

    name: ClassVar[str] = "all_equal_rewards"
    Config: ClassVar[type[AllEqualRewardsConfig]] = AllEqualRewardsConfig

    def keep(self, group: Group) -> bool:
        scores = [s.score for s in group.samples if s.status == Status.COMPLETED]
        if len(scores) < 2:
            return False
        return max(scores) - min(scores) > self.config.tolerance


class MinResponseLengthConfig(ComponentConfig):
    min_tokens: int = Field(1, ge=1, description="Drop the group if any completed response is shorter.")


class MinResponseLength(GroupFilter):
    """Drop groups holding a completed response shorter than min_tokens (e.g. empty answers)."""

    name: ClassVar[str] = "min_response_length"
    Config: ClassVar[type[MinResponseLengthConfig]] = MinResponseLengthConfig

    def keep(self, group: Group) -> bool:
        return all(len(s.response_ids) >= self.config.min_tokens for s in group.samples if s.status == Status.COMPLETED)


@hookimpl
def register_group_filters():
    return [AllEqualRewards, MinResponseLength]
