"""The data that flows through a run: sample parameters, samples, groups, statuses.

A *sample* is one rollout of one prompt; a *group* is the ``prompt_repeat_k`` samples of one
prompt. Every response token carries the policy version that produced it
(``Sample.token_versions``), so staleness is measured in one unit everywhere: policy versions
(the rule and the token mask are in :mod:`rlcli.produce.staleness`).
"""

from __future__ import annotations

import copy
import enum
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Status(str, enum.Enum):
    """Lifecycle of a sample (and, through :func:`group_status`, of a group)."""

    INIT = "init"
    COMPLETED = "completed"
    ABORTED = "aborted"
    EXPIRED = "expired"
    FAILED = "failed"
    FILTERED = "filtered"


# finish_reason -> status. Anything unknown is a failure, never a crash.
_FINISH_TO_STATUS = {
    "stop": Status.COMPLETED,
    "length": Status.COMPLETED,
    "tool_calls": Status.COMPLETED,
    "abort": Status.ABORTED,
}


def status_from_finish_reason(reason: str | None) -> Status:
    return _FINISH_TO_STATUS.get(reason or "", Status.FAILED)


def group_status(samples: list["Sample"]) -> Status:
    """The status of a group, from its members.

    ABORTED > EXPIRED > FILTERED > INIT come first (the group is not done). Otherwise the group is
    COMPLETED when at least one member is COMPLETED: members FAILED by a judger error or an engine
    error are left out of training, the rest of the group still trains (XTuner drops the whole
    group, so one flaky judger call could starve a run). All members FAILED -> FAILED.
    """
    statuses = {s.status for s in samples}
    if statuses == {Status.COMPLETED}:
        return Status.COMPLETED
    for st in (Status.ABORTED, Status.EXPIRED, Status.FILTERED, Status.INIT):
        if st in statuses:
            return st
    return Status.COMPLETED if Status.COMPLETED in statuses else Status.FAILED


EXCLUDE_FROM_LOSS = "exclude_from_loss"
"""Reward key: a judger that sets it true keeps its sample in the group's advantages but out of the
loss (DAPO's overlong filtering, ``overlong`` judger); counted in ``rollout/loss_excluded_samples``."""


class SampleParams(BaseModel):
    """How one response is sampled. ``temperature: 0`` means greedy."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(256, gt=0, description="Upper bound on response tokens.")
    min_tokens: int = Field(0, ge=0, description="Stop tokens are suppressed until this many are generated.")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop ids besides the tokenizer's EOS.")
    ignore_eos: bool = Field(False, description="Generate exactly max_tokens (benchmarks).")
    return_logprob: bool = Field(
        True, description="The engine returns each response token's logprob: train_worker.rollout_is and the "
        "mismatch/* metrics need them. false: an engine may skip them (bare vLLM decoded 2.3x faster without them "
        "on a 152k vocabulary); those metrics are then not logged.")

    @model_validator(mode="after")
    def _check(self) -> "SampleParams":
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        return self


@dataclass
class Sample:
    """One rollout of one prompt (XTuner's RolloutState)."""

    uid: int
    group_id: int
    task_name: str
    prompt_ids: list[int]
    messages: list[dict[str, Any]] = field(default_factory=list)
    data_source: str = ""
    label: Any = None  # reward_model.ground_truth
    reward_model: dict[str, Any] = field(default_factory=dict)
    extra_info: dict[str, Any] = field(default_factory=dict)
    prompt_text: str = ""
    # engine output
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)  # 1 = trained on
    token_versions: list[int] = field(default_factory=list)  # policy version per response token
    response: str = ""
    finish_reason: str | None = None
    status: Status = Status.INIT
    # judger output
    reward: dict[str, Any] | None = None
    error: str | None = None
    # bookkeeping
    temperature: float = 1.0
    tries: int = 0  # how many times this sample was re-rolled from scratch
    resumes: int = 0  # how many times a partial response was continued
    staleness: int = 0
    gen_time_s: float = 0.0

    @property
    def score(self) -> float:
        return float((self.reward or {}).get("score", 0.0))

    @property
    def excluded_from_loss(self) -> bool:
        """Its judger asked (reward key :data:`EXCLUDE_FROM_LOSS`) that it not be trained on.

        Only the value ``True`` itself asks it: a string such as ``"false"`` or ``"yes"``, a number
        or None leaves the sample in the loss (the judge pool already rejects a non-bool value).
        """
        return (self.reward or {}).get(EXCLUDE_FROM_LOSS) is True

    def reset_response(self) -> None:
        """Drop everything generated so far; keep the prompt (used for re-rolls)."""
        self.response_ids, self.logprobs, self.response_mask, self.token_versions = [], [], [], []
        self.response, self.finish_reason, self.reward, self.error = "", None, None, None
        self.status = Status.INIT
        self.staleness = 0

    def oldest_version(self) -> int | None:
        return min(self.token_versions) if self.token_versions else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        d = dict(d)
        d["status"] = Status(d["status"])
        return cls(**d)

    def clone(self) -> "Sample":
        return copy.deepcopy(self)


@dataclass
class Group:
    """The samples of one prompt, stored and moved as a unit."""

    group_id: int
    task_name: str
    samples: list[Sample]

    @property
    def status(self) -> Status:
        return group_status(self.samples)

    @property
    def staleness(self) -> int:
        return max((s.staleness for s in self.samples), default=0)

    def to_dict(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "task_name": self.task_name, "samples": [s.to_dict() for s in self.samples]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Group":
        return cls(d["group_id"], d["task_name"], [Sample.from_dict(s) for s in d["samples"]])
