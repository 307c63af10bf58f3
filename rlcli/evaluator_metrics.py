"""Evaluator metrics: reduce judged evaluation samples to scalars.

A metric is a component of kind ``evaluator_metric`` with ``compute(samples) -> {name: float}``.
:func:`evaluate` runs the recipe's metrics over all samples and, when the samples come from more
than one ``data_source``, once more per source with keys prefixed ``<source>/``.

Built-ins:

``accuracy``
    Fraction of samples that are correct (0.0 when there are none): by default a sample is correct
    when its score is at least 1.0, the full score of the built-in judgers, so a partial-credit
    judger does not inflate it; ``correct_at`` sets another full score, or ``positive`` counts any
    score above 0 (XTuner's rule). FAILED samples (judger error or timeout) count as wrong and
    are also counted in ``failed``.
``pass_at_k``
    ``pass@k`` per prompt (samples grouped by ``(task_name, group_id)``), averaged over prompts,
    for each configured ``k`` not larger than the smallest group; an attempt succeeds when it is
    correct by ``accuracy``'s rule (its own ``correct_at``, the same default). By default the *unbiased*
    estimator ``1 - C(n-c, k) / C(n, k)`` (n attempts, c successes), which uses every attempt and
    does not depend on their order. XTuner instead reports "any success among the *first* k
    attempts"; set ``estimator: first_k`` for that. Also reported: ``avg_pass@n`` (mean success
    rate at the group size n, XTuner's ``avg_pass@k``), ``mean_score``, ``groups`` and
    ``attempts``.
``reward_stats``
    Mean / population std / min / max of the score over samples that have a reward.

:func:`eval_batch_size` decides how many prompts one evaluation uses.
"""

from __future__ import annotations

import math
from collections import defaultdict
from math import comb
from typing import Any, ClassVar, Iterable, Literal

from pydantic import Field, field_validator

from rlcli import hookimpl
from rlcli.component import Component, ComponentConfig
from rlcli.types import Sample, Status

__all__ = [
    "AccuracyMetric",
    "EvaluatorMetric",
    "PassAtKMetric",
    "RewardStatsMetric",
    "eval_batch_size",
    "evaluate",
    "is_success",
    "pass_at_k",
]


def is_success(sample: Sample, correct_at: float | str = 1.0) -> bool:
    """A sample counts as solved when it was judged (not FAILED) and its score reaches ``correct_at``
    (``"positive"``: is above 0)."""
    if sample.status == Status.FAILED or sample.reward is None:
        return False
    return sample.score > 0 if correct_at == "positive" else sample.score >= correct_at


class CorrectConfig(ComponentConfig):
    correct_at: float | Literal["positive"] = Field(
        1.0,
        description="When a judged sample counts as correct: its score is at least this number (default 1.0, "
        "the full score of the built-in judgers: partial credit is not correct), or, with 'positive', above 0 "
        "(XTuner's rule).",
    )


class EvaluatorMetric(Component):
    """Base class of evaluator metrics."""

    Config: ClassVar[type[ComponentConfig]] = ComponentConfig

    def compute(self, samples: list[Sample]) -> dict[str, float]:
        raise NotImplementedError


# ------------------------------------------------------------------------------ accuracy
class AccuracyConfig(CorrectConfig):
    pass


class AccuracyMetric(EvaluatorMetric):
    """Fraction of samples with full score (correct_at); FAILED samples count as wrong."""

    name: ClassVar[str] = "accuracy"
    Config: ClassVar[type[AccuracyConfig]] = AccuracyConfig

    def compute(self, samples: list[Sample]) -> dict[str, float]:
        n = len(samples)
        solved = sum(is_success(s, self.config.correct_at) for s in samples)
        failed = sum(s.status == Status.FAILED for s in samples)
        return {"accuracy": solved / n if n else 0.0, "failed": float(failed)}


# ------------------------------------------------------------------------------ pass@k
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with ``n`` attempts of which ``c`` succeeded: 1 - C(n-c,k)/C(n,k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


class PassAtKConfig(CorrectConfig):
    k: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8, 16],
        description="The k values to report; those larger than the smallest group are skipped.",
    )
    estimator: Literal["unbiased", "first_k"] = Field(
        "unbiased",
        description="unbiased: 1 - C(n-c,k)/C(n,k) over all n attempts; first_k: any success among the first k "
        "attempts (XTuner's definition).",
    )

    @field_validator("k")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("at least one k is required")
        if any(k < 1 for k in v):
            raise ValueError(f"every k must be >= 1, got {v}")
        return sorted(set(v))


def _groups(samples: Iterable[Sample]) -> list[list[Sample]]:
    groups: dict[tuple[str, int], list[Sample]] = defaultdict(list)
    for s in samples:
        groups[(s.task_name, s.group_id)].append(s)
    return [sorted(g, key=lambda s: s.uid) for g in groups.values()]


class PassAtKMetric(EvaluatorMetric):
    """pass@k over prompts (unbiased estimator by default), plus the mean score."""

    name: ClassVar[str] = "pass_at_k"
    Config: ClassVar[type[PassAtKConfig]] = PassAtKConfig
    config: PassAtKConfig

    def compute(self, samples: list[Sample]) -> dict[str, float]:
        groups = _groups(samples)
        out: dict[str, float] = {"groups": float(len(groups)), "attempts": float(len(samples))}
        if not groups:
            return out
        out["mean_score"] = sum(s.score for s in samples if s.status != Status.FAILED) / len(samples)
        n_min = min(len(g) for g in groups)
        wins = [[is_success(s, self.config.correct_at) for s in g] for g in groups]
        for k in self.config.k:
            if k > n_min:
                continue
            if self.config.estimator == "unbiased":
                values = [pass_at_k(len(w), sum(w), k) for w in wins]
            else:
                values = [float(any(w[:k])) for w in wins]
            out[f"pass@{k}"] = sum(values) / len(values)
        out[f"avg_pass@{n_min}"] = sum(sum(w) / len(w) for w in wins) / len(wins)
        return out


# ------------------------------------------------------------------------- reward stats
class RewardStatsConfig(ComponentConfig):
    pass


class RewardStatsMetric(EvaluatorMetric):
    """Mean, std, min and max of the score over samples that were judged."""

    name: ClassVar[str] = "reward_stats"
    Config: ClassVar[type[RewardStatsConfig]] = RewardStatsConfig

    def compute(self, samples: list[Sample]) -> dict[str, float]:
        scores = [s.score for s in samples if s.reward is not None and s.status != Status.FAILED]
        out: dict[str, float] = {"reward/count": float(len(scores))}
        if not scores:
            return out
        mean = sum(scores) / len(scores)
        out.update({
            "reward/mean": mean,
            "reward/std": math.sqrt(sum((x - mean) ** 2 for x in scores) / len(scores)),
            "reward/min": min(scores),
            "reward/max": max(scores),
        })
        return out


# ------------------------------------------------------------------------------ helpers
def _merge(into: dict[str, float], new: dict[str, float], metric: Any, prefix: str) -> None:
    for key, value in new.items():
        full = f"{prefix}{key}"
        if full in into:
            raise ValueError(
                f"evaluator metric {getattr(metric, 'name', type(metric).__name__)!r} reports {full!r}, "
                "which another metric already reported; remove one of them"
            )
        into[full] = float(value)


def evaluate(samples: list[Sample], metrics: Iterable[Any]) -> dict[str, float]:
    """Run every metric on all samples and, with several data sources, on each source (``<source>/key``).

    ``metrics`` are metric instances (anything with ``compute(samples)``). Two metrics reporting
    the same key is an error rather than a silent overwrite.
    """
    metrics = list(metrics)
    out: dict[str, float] = {}
    by_source: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_source[s.data_source or "unknown"].append(s)
    for metric in metrics:
        _merge(out, metric.compute(samples), metric, "")
    if len(by_source) > 1:
        for source in sorted(by_source):
            for metric in metrics:
                _merge(out, metric.compute(by_source[source]), metric, f"{source}/")
    return out


def eval_batch_size(dataset_size: int, sample_num: int = 0, sample_ratio: float = 0.0) -> int:
    """Prompts per evaluation: ``sample_num`` if > 0; else ``int(size * ratio)`` if ratio > 0; else all.

    Raises ValueError for an empty dataset when ``sample_num`` is not given.
    """
    if sample_num < 0 or not 0.0 <= sample_ratio <= 1.0:
        raise ValueError(f"sample_num must be >= 0 and sample_ratio in [0, 1], got {sample_num}, {sample_ratio}")
    if sample_num > 0:
        return sample_num
    if dataset_size <= 0:
        raise ValueError("the evaluation dataset is empty; set eval.evaluator.sample_num or add prompts")
    if sample_ratio > 0:
        return max(1, int(dataset_size * sample_ratio))
    return dataset_size


@hookimpl
def register_evaluator_metrics() -> list[type]:
    return [AccuracyMetric, PassAtKMetric, RewardStatsMetric]
