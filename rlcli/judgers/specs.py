"""Judger sections inside a judger's options: ``{name: <registered judger>, ...its options}``.

The ``composed`` judger's branches and the ``overlong`` judger's inner judger are such
sections. :func:`check_judger_spec` checks one's shape when the config is built,
:func:`judger_spec_issues` resolves it against the registry when a recipe is validated (unknown
names with the available ones, options against the judger's own ``Config`` and its own
``check_config``, nested sections included), and :func:`build_judger` builds it.
"""

from __future__ import annotations

import inspect
from typing import Any

from pydantic import ValidationError

from rlcli.component import ChecksConfig
from rlcli.plugins import PluginError, Registry


def check_judger_spec(spec: Any, what: str = "a judger section") -> dict[str, Any]:
    """``spec`` when it is a mapping with a ``name``; ValueError otherwise (``what`` names it)."""
    if not isinstance(spec, dict):
        raise ValueError(f"{what} must be a mapping like {{name: gsm8k}}, got {spec!r}")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise ValueError(f"{what} needs a 'name' naming a registered judger, got {spec!r}")
    return spec


def _options(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if k != "name"}


def judger_spec_issues(registry: Registry, where: str, spec: dict[str, Any]) -> list[tuple[str, str]]:
    """Every problem of the judger section ``spec`` found at ``where``, as (field path, message)."""
    try:
        cls = registry.get("judger", spec["name"])
    except PluginError as exc:
        return [(f"{where}.name", str(exc))]
    try:
        cfg = cls.Config.model_validate(_options(spec))
    except ValidationError as exc:
        issues = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = f"unknown key; allowed: {', '.join(cls.Config.model_fields)}"
            issues.append((f"{where}.{loc}" if loc else where, f"{msg} (options of judger {spec['name']!r})"))
        return issues
    if not isinstance(cls, ChecksConfig):
        return []
    check = cls.check_config
    nested = check(cfg, registry=registry) if "registry" in inspect.signature(check).parameters else check(cfg)
    return [(f"{where}.{field}" if field else where, msg) for field, msg in nested or []]


def build_judger(registry: Registry, spec: dict[str, Any]) -> Any:
    """The judger of the section ``spec``, built with its options."""
    cls = registry.get("judger", spec["name"])
    return cls(cls.Config.model_validate(_options(spec)))
