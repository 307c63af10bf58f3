"""The ``overlong`` judger: DAPO's overlong reward shaping around another judger.

Recipe form::

    judger:
      name: overlong
      judger: {name: gsm8k}          # the judger whose score is shaped
      max_response_len: 1024         # L: the task's agent_loop.sample_params.max_tokens
      overlong_buffer_len: 256       # B
      overlong_penalty_factor: 1.0
      exclude_truncated: false       # true: DAPO's overlong filtering

**Soft overlong punishment** (XTuner's DAPO math judger, behaviour 51): with ``n`` the number
of response tokens (``len(sample.response_ids)``, the count ``max_tokens`` bounds; tool tokens of
a multi-turn response included), the inner judger's score gets

    penalty = min(-(n - (L - B)) / B * overlong_penalty_factor, 0)

added: 0 up to ``L - B`` tokens, then linearly down to ``-overlong_penalty_factor`` at ``L``. With
L 8192, B 4096 and factor 1, a 6144-token response gets -0.5. The reward keeps the inner
judger's other keys and adds ``overlong_penalty``. XTuner counts the tokens of the re-tokenized
response text; here the sampled tokens are counted, so what is penalised is what was generated.

**Overlong filtering** (``exclude_truncated``): a response cut off at the budget (finish reason
``length``) gets the reward key ``exclude_from_loss`` (:data:`rlcli.types.EXCLUDE_FROM_LOSS`):
it still counts in its group's advantages with its shaped score, but it is left out of the
loss, and counted in ``rollout/loss_excluded_samples``.

``rlcli validate`` refuses a ``max_response_len`` other than the task's
``sample_params.max_tokens``, so the penalty is 0 to ``-overlong_penalty_factor`` for every
response the task can produce. As in ``composed``, where and how long judging runs is the
overlong judger's own ``executor`` and ``timeout_s``: the inner judger's are validated but not
used, and its ``truncated_score`` is refused (set it on the overlong judger, where it replaces
the whole judgement of a truncated response).
"""

from __future__ import annotations

import inspect
from typing import Annotated, Any, ClassVar

from pydantic import Field, field_validator

from rlcli.hookspecs import Kind
from rlcli.judgers.base import Judger, JudgerConfig
from rlcli.judgers.calls import normalize_reward
from rlcli.judgers.specs import build_judger, check_judger_spec, judger_spec_issues
from rlcli.plugins import Registry, get_registry
from rlcli.types import EXCLUDE_FROM_LOSS, Sample


def overlong_penalty(length: int, max_response_len: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment of a ``length``-token response: 0 up to
    ``max_response_len - buffer_len`` tokens, then ``-factor`` per ``buffer_len`` tokens beyond."""
    exceed = length - (max_response_len - buffer_len)
    return 0.0 if exceed <= 0 else -exceed / buffer_len * factor


class OverlongConfig(JudgerConfig):
    judger: Annotated[dict[str, Any], Kind("judger")] = Field(
        ..., description="The judger whose score is shaped: {name: <judger>, ...its options}.")
    max_response_len: int = Field(..., gt=0, description="L, in response tokens: the task's "
                                  "agent_loop.sample_params.max_tokens (rlcli validate refuses another value).")
    overlong_buffer_len: int = Field(..., gt=0, description="B: responses longer than L - B tokens are penalised, "
                                     "linearly in their length.")
    overlong_penalty_factor: float = Field(1.0, ge=0, description="The penalty at L tokens, subtracted from the "
                                           "inner judger's score.")
    exclude_truncated: bool = Field(False, description="DAPO's overlong filtering: a response cut off at max_tokens "
                                    "(finish reason 'length') still counts in its group's advantages but is left "
                                    "out of the loss (rollout/loss_excluded_samples).")

    @field_validator("judger")
    @classmethod
    def _valid_judger(cls, v: dict[str, Any]) -> dict[str, Any]:
        return check_judger_spec(v, "the inner judger")


class OverlongJudger(Judger):
    """DAPO overlong shaping: another judger's score, minus a penalty over the last tokens of the budget."""

    name: ClassVar[str] = "overlong"
    Config: ClassVar[type[OverlongConfig]] = OverlongConfig
    config: OverlongConfig

    def __init__(self, config: OverlongConfig, *, registry: Registry | None = None):
        super().__init__(config)
        self.inner = build_judger(registry or get_registry(), config.judger)

    @classmethod
    def check_config(cls, cfg: OverlongConfig, registry: Registry | None = None) -> list[tuple[str, str]]:
        """The inner judger resolved against the registry, the buffer within the budget, and options
        that would have no effect."""
        issues = judger_spec_issues(registry or get_registry(), "judger", cfg.judger)
        if cfg.overlong_buffer_len > cfg.max_response_len:
            issues.append(("overlong_buffer_len", f"{cfg.overlong_buffer_len} is more than max_response_len="
                           f"{cfg.max_response_len}: the penalty would start before the first token"))
        if cfg.judger.get("truncated_score") is not None:
            issues.append(("judger.truncated_score", "has no effect inside the overlong judger (the inner judger "
                           "is called directly); set truncated_score on the overlong judger itself"))
        if cfg.exclude_truncated and cfg.truncated_score is not None:
            issues.append(("exclude_truncated", "truncated_score scores truncated responses without calling this "
                           "judger, so none would be excluded; drop one of the two"))
        return issues

    @classmethod
    def check_recipe(cls, recipe: Any) -> list[tuple[str, str]]:
        """``max_response_len`` equals the ``max_tokens`` of each task judged by an overlong judger."""
        issues = []
        for where, task in _tasks(recipe):
            max_tokens = _max_tokens(task)
            for path, spec in _overlong_specs(f"{where}.judger", _as_dict(task.judger)):
                length = spec.get("max_response_len")
                if max_tokens is not None and isinstance(length, int) and length != max_tokens:
                    issues.append((f"{path}.max_response_len", (
                        f"{length} differs from {where}.agent_loop.sample_params.max_tokens={max_tokens}: the "
                        f"penalty must reach -overlong_penalty_factor exactly at the response budget; set it to "
                        f"{max_tokens} (overlong_buffer_len sets where the penalty starts)")))
        return issues

    def score_range(self) -> tuple[float, float]:
        """The inner judger's range, its low end lowered by the full penalty."""
        lo, hi = self.inner.score_range()
        return (lo - self.config.overlong_penalty_factor, hi)

    def judge(self, response: str, label: Any, sample: Sample) -> Any:
        result = self.inner.judge(response, label, sample)
        if inspect.isawaitable(result):  # an async inner judger: shape its result once awaited
            return self._shape_when_done(result, sample)
        return self.shape(result, sample)

    async def _shape_when_done(self, result: Any, sample: Sample) -> Any:
        return self.shape(await result, sample)

    def shape(self, result: Any, sample: Sample) -> Any:
        """The inner judger's ``result`` with the penalty of ``sample``'s length (and the exclusion
        of a truncated response); a result that is not a usable score is returned unchanged, for
        the judge pool to report."""
        reward, _ = normalize_reward(result)
        if reward is None:
            return result
        c = self.config
        penalty = overlong_penalty(len(sample.response_ids), c.max_response_len, c.overlong_buffer_len,
                                   c.overlong_penalty_factor)
        reward["score"] += penalty
        reward["overlong_penalty"] = penalty
        if c.exclude_truncated and sample.finish_reason == "length":
            reward[EXCLUDE_FROM_LOSS] = True
        return reward


def _tasks(recipe: Any) -> list[tuple[str, Any]]:
    out = [(f"tasks.{i}", t) for i, t in enumerate(getattr(recipe, "tasks", None) or [])]
    ev = getattr(recipe, "eval", None)
    return out + [(f"eval.tasks.{i}", t) for i, t in enumerate(getattr(ev, "tasks", None) or [])]


def _max_tokens(task: Any) -> int | None:
    try:
        loop_cfg = task.agent_loop.cfg
    except RuntimeError:  # the agent loop did not resolve: reported elsewhere
        return None
    from rlcli.config.fit import task_max_tokens

    return task_max_tokens(loop_cfg)


def _as_dict(spec: Any) -> dict[str, Any]:
    return {"name": spec.name, **(spec.model_extra or {})}


def _overlong_specs(path: str, node: Any) -> list[tuple[str, dict[str, Any]]]:
    """Every ``{name: overlong, ...}`` section in ``node`` (itself, composed branches, inner judgers)."""
    found = []
    if isinstance(node, dict):
        if node.get("name") == OverlongJudger.name:
            found.append((path, node))
        for key, value in node.items():
            found += _overlong_specs(f"{path}.{key}", value)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _overlong_specs(f"{path}.{i}", value)
    return found
