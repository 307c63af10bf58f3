"""The recipe: a YAML file validated by the pydantic models of :mod:`rlcli.config.sections`.

Sections: ``model``, ``trainer``, ``resources``, ``rollout``, ``train_worker``, ``advantage``,
``replay_buffer``, ``tasks``, ``eval``. Every *component* section is ``{name: <registered
name>, ...its own config}``; the name is looked up in the plugin registry and the rest is
validated by that component's own ``Config``. :func:`load_recipe` is the single code path used
by ``train``, ``eval`` and ``validate``: it loads, applies overrides, validates and resolves, and
reports *every* problem at once, each with its dotted path. Nothing here loads a model.

The package, by responsibility: ``sections`` (the pydantic section models, built from ``spec``'s
strict models and component specs), ``tree`` (walkers over their schema), ``issues`` (``Issue``,
``RecipeError``), ``resolve`` (component sections through the plugin registry), ``rules`` (the
cross-field rules over the raw dict), ``placement`` (disaggregated rank placement), ``fit`` (the
recipe against the model's shape and the launch's ranks), ``yaml_file`` (reading the file: UTF-8,
nesting depth, duplicate keys) and ``load`` (overrides, the ``validate_recipe`` / ``load_recipe``
entry points). Import from ``rlcli.config``; it re-exports all of them.
"""

from __future__ import annotations

from rlcli.config.fit import (
    check_fit, check_prompt_lengths, check_task_shares, model_context, model_shape, task_max_tokens,
)
from rlcli.config.issues import Issue, RecipeError
from rlcli.config.load import _recipe_checks, load_recipe, resolved_dict, validate_recipe
from rlcli.config.placement import (
    ROLLOUT_RESOURCES,
    TRAIN_RESOURCES,
    _check_disaggregated,
    _placement_side,
    check_launch,
    resolve_placement,
)
from rlcli.config.resolve import _issue_from_pydantic, _resolve_component
from rlcli.config.rules import _check_rules, _check_tasks, _positive_or_disabled
from rlcli.config.sections import (
    EvalConfig,
    EvaluatorConfig,
    FromScratch,
    FSDPConfig,
    KLConfig,
    LoraConfig,
    LRSchedulerConfig,
    ModelConfig,
    OptimizerConfig,
    PlacementConfig,
    Recipe,
    ResourcesConfig,
    RolloutISConfig,
    TaskConfig,
    TrainerConfig,
    TrainWorkerConfig,
)
from rlcli.config.spec import ComponentSpec, Kind, Strict, _spec
from rlcli.config.tree import _collect_specs, _dotted, _kind_of, _model_class_at, _unwrap, _walk_raw
from rlcli.config.yaml_file import read_yaml

__all__ = [
    "ROLLOUT_RESOURCES", "TRAIN_RESOURCES", "ComponentSpec", "EvalConfig", "EvaluatorConfig", "FSDPConfig",
    "FromScratch", "Issue", "KLConfig", "Kind", "LoraConfig", "LRSchedulerConfig", "ModelConfig", "OptimizerConfig",
    "PlacementConfig", "Recipe", "RecipeError", "ResourcesConfig", "RolloutISConfig", "Strict", "TaskConfig",
    "TrainWorkerConfig", "TrainerConfig", "check_fit", "check_launch", "check_prompt_lengths", "check_task_shares",
    "model_context", "model_shape", "load_recipe", "read_yaml", "resolve_placement",
    "resolved_dict", "task_max_tokens", "validate_recipe",
    # private helpers, kept importable from here as before the split (docgen, tests)
    "_check_disaggregated", "_check_rules", "_check_tasks", "_collect_specs", "_dotted", "_issue_from_pydantic",
    "_kind_of", "_model_class_at", "_placement_side", "_positive_or_disabled", "_recipe_checks",
    "_resolve_component", "_spec", "_unwrap", "_walk_raw",
]
