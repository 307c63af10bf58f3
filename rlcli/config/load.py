"""The entry points: read the YAML, apply overrides, validate and resolve; the resolved dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rlcli.component import ChecksRecipe
from rlcli.config.fit import _task_lengths, check_fit
from rlcli.config.issues import Issue, RecipeError
from rlcli.config.resolve import _issue_from_pydantic, _resolve_component
from rlcli.config.rules import _check_rules
from rlcli.config.sections import Recipe
from rlcli.config.spec import ComponentSpec
from rlcli.config.tree import _walk_raw
from rlcli.config.yaml_file import read_yaml
from rlcli.overrides import OverrideError, apply_overrides
from rlcli.plugins import Registry, get_registry


def validate_recipe(raw: Any, registry: Registry | None = None, source: str | None = None,
                    base_dir: str | Path | None = None) -> Recipe:
    """Validate and resolve raw recipe data; raise :class:`RecipeError` listing every problem.

    ``base_dir`` (default: the folder of ``source``) is where relative data paths also resolve.
    """
    from rlcli.data.sampler import RECIPE_DIR

    registry = registry or get_registry()
    if base_dir is None and source is not None:
        base_dir = Path(source).resolve().parent
    if base_dir is not None:
        RECIPE_DIR.set(Path(base_dir))
    if not isinstance(raw, dict):
        raise RecipeError([Issue("", f"a recipe must be a YAML mapping, got {type(raw).__name__}")], source)
    issues: list[Issue] = []
    recipe: Recipe | None = None
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as exc:
        for err in exc.errors():
            issues.append(_issue_from_pydantic(Recipe, err))
    _check_rules(raw, issues)

    found: list = []
    if recipe is not None:
        for path, kind, spec in recipe.components():
            found.append((tuple(int(p) if p.isdigit() else p for p in path.split(".")), kind, spec))
    else:
        _walk_raw(Recipe, raw, (), found)
    for path, kind, spec in found:
        resolved = _resolve_component(registry, path, kind, spec, issues)
        if resolved is not None and isinstance(spec, ComponentSpec):
            spec._cls, spec._cfg = resolved

    if recipe is not None:
        issues += check_fit(recipe)
        issues += _fill_loss_scale_factor(recipe)
        for check in _recipe_checks(registry):
            for path, msg in check(recipe) or []:
                issues.append(Issue(path, msg))
    # de-duplicate while keeping order
    uniq = list(dict.fromkeys(issues))
    if uniq:
        raise RecipeError(uniq, source)
    assert recipe is not None
    recipe._registry = registry
    if source is not None:
        recipe._source = Path(source)
    return recipe


def _fill_loss_scale_factor(recipe: Recipe) -> list[Issue]:
    """``train_worker.loss.loss_scale_factor`` left null with ``loss_agg: seq-mean-token-sum-norm``
    becomes the largest ``max_tokens`` of the training tasks (verl's default, the longest response),
    so that the constant is fixed, and written in resolved.yaml, before the run starts."""
    spec = recipe.train_worker.loss
    cfg = spec._cfg
    if (cfg is None or "loss_scale_factor" not in type(cfg).model_fields
            or cfg.loss_scale_factor is not None or getattr(cfg, "loss_agg", None) != "seq-mean-token-sum-norm"):
        return []
    budgets = [max_tokens for _, trains, _, max_tokens in _task_lengths(recipe) if trains]
    if not budgets:
        return [Issue("train_worker.loss.loss_scale_factor", "loss_agg 'seq-mean-token-sum-norm' divides each "
                      "sequence's token sum by a constant, and no training task has agent_loop.sample_params."
                      "max_tokens to take it from: set loss_scale_factor (e.g. the longest response in tokens)")]
    spec._cfg = cfg.model_copy(update={"loss_scale_factor": float(max(budgets))})
    return []


def _recipe_checks(registry: Registry) -> list:
    """Whole-recipe checks a component class declares with ``check_recipe(recipe) -> [(path, msg)]``."""
    checks = []
    seen = set()
    for table in registry.entries.values():
        for entry in table.values():
            if not isinstance(entry.cls, ChecksRecipe):
                continue
            fn = entry.cls.check_recipe
            if id(fn) not in seen:
                seen.add(id(fn))
                checks.append(fn)
    return checks


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = (), registry: Registry | None = None) -> Recipe:
    """Load a recipe file, apply ``key=value`` / ``~key`` overrides, validate and resolve it."""
    raw = read_yaml(path)
    try:
        raw = apply_overrides(raw, list(overrides))
    except OverrideError as exc:
        raise RecipeError([Issue(exc.path, exc.message)], str(path)) from None
    recipe = validate_recipe(raw, registry, source=str(path))
    recipe._source = Path(path)
    return recipe


def resolved_dict(recipe: Recipe) -> dict:
    """The recipe with every default and every component option filled in (for resolved.yaml)."""
    data = recipe.model_dump(mode="json")
    for path, _kind, spec in recipe.components():
        cur: Any = data
        parts = [int(p) if p.isdigit() else p for p in path.split(".")]
        for p in parts[:-1]:
            cur = cur[p]
        cur[parts[-1]] = {"name": spec.name, **spec.cfg.model_dump(mode="json")}
    return data
