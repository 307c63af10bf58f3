"""The judger contract.

A judger scores one COMPLETED response: ``judge(response, label, sample) -> float | dict``.
A float is wrapped as ``{"score": x}``; a dict must contain ``"score"``. The runner calls
judgers in a pool of worker processes by default (``executor: process``), so a judger must be
picklable unless its config says ``executor: thread`` (or ``inline``). Each call has a timeout
and each worker a memory limit, so an exception, a hang, a crash or a runaway allocation marks
only that sample FAILED, never the run. With ``truncated_score`` set, a response that never
reached EOS (cut off at ``max_tokens``) gets that score and the judger is not called.
A reward dict holding ``"exclude_from_loss": True`` (:data:`rlcli.types.EXCLUDE_FROM_LOSS`)
keeps its sample in its group's advantages but out of the loss (the ``overlong`` judger's
``exclude_truncated``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from rlcli.component import Component, ComponentConfig
from rlcli.types import Sample


class JudgerConfig(ComponentConfig):
    timeout_s: float = Field(30.0, gt=0, description="Per-call timeout; a timed-out sample is FAILED.")
    truncated_score: float | None = Field(
        None, description="Score of a response cut off at max_tokens (finish reason 'length', no EOS), given "
        "without calling the judger; null: such responses are judged like any other.")
    executor: Literal["inline", "thread", "process"] = Field(
        "process", description="Where judge() runs: process (worker processes, killed on timeout, memory-capped), "
        "thread (for judgers that cannot be pickled: no memory limit, a hung call cannot be killed) or inline (in "
        "the event loop, no timeout).")
    memory_limit_mb: int | None = Field(
        2048, gt=0, description="Memory cap (MB) of each judge worker process with executor process: what the "
        "judger may allocate beyond what the worker starts with (RLIMIT_DATA, Linux); a call that exceeds it is "
        "FAILED and its worker replaced. null: no limit.")


class Judger(Component):
    """Base class of judgers: score one COMPLETED response (the module docstring has the contract).

    ``judge(response, label, sample)`` returns a float or a dict holding a float ``"score"``, for
    any response - empty, garbage or huge - within ``score_range()``, the same score for the same
    input, and within ``config.timeout_s``. :mod:`rlcli.testing.judger_conformance` checks this.
    """

    Config: ClassVar[type[JudgerConfig]] = JudgerConfig

    def judge(self, response: str, label: Any, sample: Sample) -> float | dict[str, Any]:
        raise NotImplementedError

    def score_range(self) -> tuple[float, float]:
        """The lowest and the highest score ``judge`` returns with this config; (0.0, 1.0) unless
        overridden. ``truncated_score`` is not part of it (the judger is not called then)."""
        return (0.0, 1.0)


def require_label(label: Any, *, allow_blank: bool = True) -> str:
    """``label`` as text; a missing label (or, with ``allow_blank=False``, a blank one) raises, so
    that the sample is FAILED with a message saying what it lacks."""
    if label is None or (not allow_blank and not str(label).strip()):
        raise ValueError("sample has no label (reward_model.ground_truth) to compare with")
    return str(label)
