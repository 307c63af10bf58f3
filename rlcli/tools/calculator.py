"""The ``calculator`` tool: exact arithmetic on a parsed expression, never ``eval``.

The expression is parsed with :mod:`ast` and only these nodes are accepted: numbers (int and
decimal literals; booleans, complex numbers and everything else are rejected), parentheses,
unary ``-``/``+`` and the binary operators ``+ - * / // % **``. ``×``, ``÷``, ``−`` and ``^``
are read as ``*``, ``/``, ``-`` and ``**``, and thousands separators (``1,000``) are dropped.
Arithmetic is exact (:class:`fractions.Fraction`): ``0.1 + 0.2`` is ``0.3`` and ``7/2`` is
``3.5``; a non-terminating quotient is printed rounded to ``decimals`` places.

Every bound is checked *before* the work is done, so no input can make a call slow or large:
the expression length, the number of AST nodes, the nesting depth, the exponent
(``|exponent| <= max_exponent``, integer exponents only), and the size of every intermediate
value (at most ``max_digits`` digits in numerator and denominator). A violated bound, a syntax
error or a division by zero is reported as ``error: ...`` text.
"""

from __future__ import annotations

import ast
import math
import re
from fractions import Fraction
from typing import Any, ClassVar

from pydantic import Field

from rlcli.tools.base import Tool, ToolConfig, ToolOutput

_LOG10_2 = math.log10(2)
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_REPLACE = {"×": "*", "÷": "/", "−": "-", "^": "**"}


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be evaluated (shown to the model as the tool output)."""


class CalculatorConfig(ToolConfig):
    max_expression_chars: int = Field(512, gt=0, description="Longer expressions are rejected.")
    max_nodes: int = Field(256, gt=0, description="Most numbers and operations in one expression.")
    max_depth: int = Field(
        256, gt=0, le=400, description="Deepest nesting of parentheses and operators (a chain a+b+c counts one per operator).")
    max_exponent: int = Field(1024, ge=0, description="Largest |exponent| of '**' (integer exponents only).")
    max_digits: int = Field(
        4000, gt=0, description="Largest value (digits of numerator or denominator) any step may produce.")
    decimals: int = Field(10, ge=0, le=100, description="Places printed for a non-terminating quotient.")


def _digits(n: int) -> int:
    """An upper bound on the number of decimal digits of ``n`` (cheap: from the bit length)."""
    return int(abs(n).bit_length() * _LOG10_2) + 1


def format_number(value: Fraction, decimals: int = 10) -> str:
    """``17834``, ``3.5``, ``-0.125``; a non-terminating value rounded to ``decimals`` places."""
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    while den % 2 == 0:
        den //= 2
    while den % 5 == 0:
        den //= 5
    if den == 1:  # terminating: print exactly
        places = 0
        scaled = abs(value)
        while scaled.denominator != 1:
            scaled *= 10
            places += 1
        text = str(scaled.numerator).rjust(places + 1, "0")
        return ("-" if value < 0 else "") + f"{text[:-places]}.{text[-places:]}"
    scaled = round(abs(value) * 10**decimals)  # round half to even, on exact rationals
    text = str(scaled).rjust(decimals + 1, "0")
    whole, frac = text[: len(text) - decimals], text[len(text) - decimals:].rstrip("0")
    out = f"{whole}.{frac}" if frac else whole
    return "-" + out if value < 0 and out.strip("0.") else out


class ArithmeticInterpreter:
    """Evaluates one parsed expression under the bounds of a :class:`CalculatorConfig`."""

    def __init__(self, cfg: CalculatorConfig):
        self.cfg = cfg

    def parse(self, expression: str) -> ast.expr:
        cfg = self.cfg
        if not isinstance(expression, str):
            raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
        text = expression.strip()
        if not text:
            raise CalculatorError("empty expression")
        if len(text) > cfg.max_expression_chars:
            raise CalculatorError(f"expression longer than {cfg.max_expression_chars} characters")
        for old, new in _REPLACE.items():
            text = text.replace(old, new)
        text = _THOUSANDS.sub("", text)
        if text.count("(") > cfg.max_depth:  # cheap guard before the parser recurses
            raise CalculatorError(f"expression nested deeper than {cfg.max_depth} levels")
        try:
            tree = ast.parse(text, mode="eval")
        except SyntaxError as exc:
            raise CalculatorError(f"invalid expression: {exc.msg}") from None
        except (RecursionError, MemoryError, ValueError):
            raise CalculatorError("invalid expression") from None
        nodes = sum(1 for n in ast.walk(tree) if isinstance(n, ast.expr))
        if nodes > cfg.max_nodes:
            raise CalculatorError(f"expression has more than {cfg.max_nodes} parts")
        return tree.body

    def evaluate(self, expression: str) -> Fraction:
        return self._eval(self.parse(expression), 0)

    def _check(self, value: Fraction) -> Fraction:
        limit = self.cfg.max_digits
        if _digits(value.numerator) > limit or _digits(value.denominator) > limit:
            raise CalculatorError(f"result larger than {limit} digits")
        return value

    def _eval(self, node: ast.AST, depth: int) -> Fraction:
        if depth > self.cfg.max_depth:
            raise CalculatorError(f"expression nested deeper than {self.cfg.max_depth} levels")
        if isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise CalculatorError(f"only numbers are allowed, got {v!r}")
            if isinstance(v, float):
                if not math.isfinite(v):
                    raise CalculatorError("numbers must be finite")
                return self._check(Fraction(repr(v)))
            return self._check(Fraction(v))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = self._eval(node.operand, depth + 1)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp):
            left = self._eval(node.left, depth + 1)
            right = self._eval(node.right, depth + 1)
            return self._check(self._binop(node.op, left, right))
        raise CalculatorError(f"{type(node).__name__} is not allowed (numbers, + - * / // % ** and parentheses only)")

    def _binop(self, op: ast.operator, a: Fraction, b: Fraction) -> Fraction:
        if isinstance(op, ast.Add):
            return a + b
        if isinstance(op, ast.Sub):
            return a - b
        if isinstance(op, ast.Mult):
            return a * b
        if isinstance(op, (ast.Div, ast.FloorDiv, ast.Mod)):
            if b == 0:
                raise CalculatorError("division by zero")
            if isinstance(op, ast.Div):
                return a / b
            return Fraction(a // b) if isinstance(op, ast.FloorDiv) else a % b
        if isinstance(op, ast.Pow):
            return self._pow(a, b)
        raise CalculatorError(f"operator {type(op).__name__} is not allowed")

    def _pow(self, base: Fraction, exp: Fraction) -> Fraction:
        cfg = self.cfg
        if exp.denominator != 1:
            raise CalculatorError("only integer exponents are allowed")
        e = exp.numerator
        if abs(e) > cfg.max_exponent:
            raise CalculatorError(f"exponent larger than {cfg.max_exponent}")
        if base == 0 and e < 0:
            raise CalculatorError("division by zero")
        # the result's size is known before computing it: digits(x ** e) <= |e| * digits(x)
        num = abs(base.numerator)
        worst = max(math.log10(num) if num > 1 else 0.0, math.log10(base.denominator))
        if abs(e) * worst > cfg.max_digits:
            raise CalculatorError(f"result larger than {cfg.max_digits} digits")
        return base**e


class Calculator(Tool):
    """Evaluates an arithmetic expression exactly (+ - * / // % ** and parentheses)."""

    name: ClassVar[str] = "calculator"
    Config: ClassVar[type[CalculatorConfig]] = CalculatorConfig
    config: CalculatorConfig
    run_inline: ClassVar[bool] = True  # bounded by construction: microseconds, no thread needed
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "Arithmetic, e.g. \"(12 + 3) * 4 / 5\"."}},
        "required": ["expression"],
    }

    def __init__(self, config: CalculatorConfig | None = None):
        super().__init__(config)
        self._interpreter = ArithmeticInterpreter(self.config)

    def evaluate(self, expression: str) -> str:
        """The formatted value of ``expression``; raises :class:`CalculatorError`."""
        return format_number(self._interpreter.evaluate(expression), self.config.decimals)

    def call(self, arguments: dict[str, Any]) -> str | ToolOutput:
        unknown = sorted(set(arguments) - {"expression"})
        if "expression" not in arguments:
            return ToolOutput("error: missing argument 'expression'", ok=False)
        if unknown:
            return ToolOutput(f"error: unknown argument(s) {', '.join(map(repr, unknown))}", ok=False)
        try:
            return self.evaluate(arguments["expression"])
        except CalculatorError as exc:
            return ToolOutput(f"error: {exc}", ok=False)
