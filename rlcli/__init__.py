"""rlcli: reinforcement learning for language models (GRPO and family) from one YAML recipe."""

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("rlcli")
"""Marker for plugin hook implementations: ``from rlcli import hookimpl``."""

__all__ = ["__version__", "hookimpl"]
