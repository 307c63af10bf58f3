"""Tools an agent loop can call by name (being built: see the multi-turn agent loop)."""

from __future__ import annotations

from rlcli import hookimpl
from rlcli.component import Component


class Tool(Component):
    """Base class of tools."""


@hookimpl
def register_tools():
    return []
