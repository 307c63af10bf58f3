"""Every hook a plugin can implement.

Each ``register_*`` hook returns a list of component classes. A component class has a unique
``name`` (what recipes write), a pydantic ``Config`` model (what recipes may set under that
name; unknown keys are rejected) and a one-line docstring (what ``rlcli plugins`` shows).
Built-in components are registered through these same hooks. ``docs/plugins.md`` documents
each hook; a test fails if one is missing there.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("rlcli")


@hookspec
def register_agent_loops() -> list[type]:
    """Agent loops: turn a group of prompts into judged responses (single turn, tool use, ...)."""


@hookspec
def register_judgers() -> list[type]:
    """Judgers: score one response against its label, returning ``{"score": float, ...}``."""


@hookspec
def register_produce_strategies() -> list[type]:
    """Produce strategies: decide how many groups to roll out and when (sync, async, ...)."""


@hookspec
def register_replay_buffers() -> list[type]:
    """Replay buffers: store rollout groups between production and training (FIFO, staleness-first, ...)."""


@hookspec
def register_inference_backends() -> list[type]:
    """Inference backends: generate tokens with logprobs, accept weight updates, pause and resume."""


@hookspec
def register_advantage_estimators() -> list[type]:
    """Advantage estimators: map a group's rewards to per-sample advantages (grpo, rloo, ...)."""


@hookspec
def register_policy_losses() -> list[type]:
    """Policy losses: per-token loss from new/old logprobs and advantages (vanilla PPO-clip, gspo, ...)."""


@hookspec
def register_evaluator_metrics() -> list[type]:
    """Evaluator metrics: reduce judged evaluation samples to scalars (accuracy, pass@k, ...)."""


@hookspec
def register_trackers() -> list[type]:
    """Experiment trackers: receive per-step scalars and sample texts (tensorboard, jsonl, ...)."""


@hookspec
def register_samplers() -> list[type]:
    """Samplers: read a dataset and hand out prompt groups, with resumable position (jsonl, ...)."""


@hookspec
def register_group_filters() -> list[type]:
    """Group filters: drop completed groups before they reach training (e.g. all-equal rewards)."""


@hookspec
def register_tools() -> list[type]:
    """Tools: functions an agent loop can call by name (calculator, sandboxed Python, ...)."""
