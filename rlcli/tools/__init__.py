"""Tools an agent loop can call by name (plugin kind ``tool``, hook ``register_tools``).

The contract is in :mod:`rlcli.tools.base`; the multi-turn agent loop
(:mod:`rlcli.agent_loops.multi_turn`) parses the model's tool calls, runs them through
:meth:`Tool.run` and appends their output as tokens that are not trained on. Built-in:
``calculator`` (exact arithmetic, no ``eval``). The separately installable ``rlcli-python-tool``
package adds ``python``, a sandboxed Python executor.
"""

from __future__ import annotations

from rlcli import hookimpl
from rlcli.tools.base import Tool, ToolConfig, ToolOutput, ToolResult, error_text, truncate_text
from rlcli.tools.calculator import Calculator, CalculatorConfig, CalculatorError

__all__ = [
    "Calculator", "CalculatorConfig", "CalculatorError", "Tool", "ToolConfig", "ToolOutput", "ToolResult",
    "error_text", "truncate_text",
]


@hookimpl
def register_tools():
    return [Calculator]
