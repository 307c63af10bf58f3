"""The ``composed`` judger: route each sample to a judger chosen by its ``data_source``.

Recipe form::

    judger:
      name: composed
      branches:
        openai/gsm8k: {name: gsm8k}
        toy/arith: {name: exact_match, first_word_only: true}
      default: {name: exact_match}     # optional: any other data_source

Each branch is ``{name: <registered judger>, ...its options}``. Branches are validated when the
recipe is validated (unknown judger names are reported with the available ones; options are
checked against the branch's own ``Config``) and built at first use. The branch's reward passes
through unchanged. A sample whose ``data_source`` has no branch and no ``default`` raises
``ValueError`` naming it and the known branches; the judge executor turns that into a FAILED
sample, never a crash.

Where and how long judging runs is decided by the composed judger's own ``executor`` and
``timeout_s``; those options inside a branch are validated but not used.

Unlike XTuner's ``ComposedJudger``, one sample goes to exactly one branch, so there is no
``merge_fn``; compose several scores inside a custom judger instead.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

from pydantic import Field, field_validator

from rlcli.judgers.base import Judger, JudgerConfig
from rlcli.judgers.specs import build_judger, check_judger_spec, judger_spec_issues
from rlcli.plugins import Registry, get_registry
from rlcli.types import Sample


def _check_branch_spec(spec: Any) -> dict[str, Any]:
    return check_judger_spec(spec, "a branch")


class ComposedConfig(JudgerConfig):
    branches: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="data_source -> {name: <judger>, ...options}: the judger for samples of that source.",
    )
    default: dict[str, Any] | None = Field(
        None, description="{name: <judger>, ...options} for samples whose data_source has no branch."
    )

    @field_validator("branches")
    @classmethod
    def _valid_branches(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for source, spec in v.items():
            try:
                _check_branch_spec(spec)
            except ValueError as exc:
                raise ValueError(f"branch {source!r}: {exc}") from None
        return v

    @field_validator("default")
    @classmethod
    def _valid_default(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if v is None else _check_branch_spec(v)


class ComposedJudger(Judger):
    """Routes each sample by its data_source to one of several judgers (optional default branch)."""

    name: ClassVar[str] = "composed"
    Config: ClassVar[type[ComposedConfig]] = ComposedConfig
    config: ComposedConfig

    def __init__(self, config: ComposedConfig | None = None, *, registry: Registry | None = None):
        super().__init__(config)
        self._registry = registry
        self._branches: dict[str, Judger] | None = None
        self._default: Judger | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ validation
    @classmethod
    def check_config(cls, cfg: ComposedConfig, registry: Registry | None = None) -> list[tuple[str, str]]:
        """Every problem of the branch specs, as (field path, message)."""
        registry = registry or get_registry()
        issues: list[tuple[str, str]] = []
        if not cfg.branches and cfg.default is None:
            issues.append(("branches", "must contain at least one judger branch (or set 'default')"))
        specs = [(f"branches.{source}", spec) for source, spec in cfg.branches.items()]
        if cfg.default is not None:
            specs.append(("default", cfg.default))
        for where, spec in specs:
            issues += judger_spec_issues(registry, where, spec)
        return issues

    # ------------------------------------------------------------------ building
    def _build(self) -> dict[str, Judger]:
        if self._branches is not None:
            return self._branches
        with self._lock:
            if self._branches is None:
                registry = self._registry or get_registry()
                branches = {source: build_judger(registry, spec) for source, spec in self.config.branches.items()}
                self._default = build_judger(registry, self.config.default) if self.config.default else None
                self._branches = branches
            return self._branches

    def branch_for(self, data_source: str | None) -> Judger:
        """The judger that scores samples of ``data_source``; ValueError when there is none."""
        branches = self._build()
        if data_source in branches:
            return branches[data_source]  # type: ignore[index]
        if self._default is not None:
            return self._default
        known = ", ".join(sorted(branches)) or "(none)"
        if not data_source:
            raise ValueError(f"composed judger needs sample.data_source to pick a branch (known branches: {known})")
        raise ValueError(f"no judger branch for data_source {data_source!r}; known branches: {known}")

    def judge(self, response: str, label: Any, sample: Sample) -> float | dict[str, Any]:
        return self.branch_for(sample.data_source).judge(response, label, sample)

    def score_range(self) -> tuple[float, float]:
        """From the lowest to the highest score of any branch."""
        branches = list(self._build().values()) + ([self._default] if self._default is not None else [])
        ranges = [j.score_range() for j in branches]
        return (min(lo for lo, _ in ranges), max(hi for _, hi in ranges))

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        # Build in the parent so worker processes never need the plugin registry; the built
        # branches travel with the pickle. The registry and the lock stay behind.
        self._build()
        state = dict(self.__dict__)
        state.pop("_lock", None)
        state["_registry"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
