"""rlcli: reinforcement learning for language models (GRPO and family) from one YAML recipe."""

import os

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("rlcli")
"""Marker for plugin hook implementations: ``from rlcli import hookimpl``."""

DEBUG_ENV = "RLCLI_DEBUG"
"""Set (to anything but ``0``) by ``rlcli --debug``: full tracebacks where rlcli prints one-line errors."""


def debug_enabled() -> bool:
    """Whether full tracebacks are wanted (``rlcli --debug`` or ``RLCLI_DEBUG=1``; ranks inherit it)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


__all__ = ["DEBUG_ENV", "__version__", "debug_enabled", "hookimpl"]
