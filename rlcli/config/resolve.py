"""Component sections resolved through the plugin registry; pydantic errors turned into issues."""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from pydantic import BaseModel, ValidationError

from rlcli.component import ChecksConfig
from rlcli.config.issues import Issue
from rlcli.config.spec import ComponentSpec
from rlcli.config.tree import _dotted, _model_class_at, _paths_of_field
from rlcli.plugins import PluginError, Registry


def _resolve_component(registry: Registry, path: tuple, kind: str, raw: Any, issues: list[Issue]):
    where = _dotted(path)
    if isinstance(raw, ComponentSpec):
        raw = {"name": raw.name, **(raw.model_extra or {})}
    if not isinstance(raw, dict):
        issues.append(Issue(where, f"expected a mapping with a 'name' key naming a {kind}, got {raw!r}"))
        return None
    name = raw.get("name")
    if not isinstance(name, str):
        issues.append(Issue(f"{where}.name", f"required: the name of a registered {kind}; "
                            f"available: {', '.join(registry.names(kind)) or '(none)'}"))
        return None
    try:
        cls = registry.get(kind, name)
    except PluginError as exc:
        issues.append(Issue(f"{where}.name", str(exc)))
        return None
    options = {k: v for k, v in raw.items() if k != "name"}
    try:
        cfg = cls.Config.model_validate(options)
    except ValidationError as exc:
        for err in exc.errors():
            issues.append(_issue_from_pydantic(cls.Config, err, path, extra=f" (options of {kind} {name!r})"))
        return None
    if isinstance(cls, ChecksConfig):
        check = cls.check_config
        takes_registry = "registry" in inspect.signature(check).parameters
        for field_name, msg in (check(cfg, registry=registry) if takes_registry else check(cfg)) or []:
            issues.append(Issue(f"{where}.{field_name}" if field_name else where, msg))
    return cls, cfg


def _issue_from_pydantic(model_cls: type[BaseModel], err: dict, prefix: tuple = (), extra: str = "") -> Issue:
    loc = tuple(err["loc"])
    path = _dotted(prefix + loc)
    if err["type"] == "extra_forbidden":
        owner = _model_class_at(model_cls, loc)
        msg = "unknown key"
        if owner is not None:
            fields = list(owner.model_fields)
            close = difflib.get_close_matches(str(loc[-1]), fields, n=1)
            elsewhere = [] if close or prefix else _paths_of_field(model_cls, str(loc[-1]))[:3]
            if elsewhere:  # the key belongs to another section of the recipe
                msg += f" here (did you mean {' or '.join(elsewhere)}?)"
            else:
                msg += f" (did you mean {close[0]!r}?)" if close else f"; allowed: {', '.join(fields)}"
        return Issue(path, msg + extra)
    if err["type"] == "missing":
        return Issue(path, "required field is missing" + extra)
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return Issue(path, msg + extra)
