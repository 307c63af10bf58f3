"""Tools: the calculator's arithmetic and bounds, and Tool.run's timeout / error / truncation contract."""

from __future__ import annotations

import asyncio
import threading
import time
from fractions import Fraction
from typing import ClassVar

import pytest
from pydantic import ValidationError

from rlcli import hookimpl
from rlcli.plugins import get_registry, registry_with
from rlcli.tools import Calculator, CalculatorConfig, Tool, ToolConfig, ToolOutput
from rlcli.tools.calculator import format_number


def calc(expr: str, **cfg) -> tuple[str, str]:
    r = asyncio.run(Calculator(CalculatorConfig(**cfg)).run({"expression": expr}))
    return r.status, r.output


# ----------------------------------------------------------------------------- calculator
@pytest.mark.parametrize("expr, value", [
    ("37*482", "17834"), ("7/2", "3.5"), ("1/3", "0.3333333333"), ("-1/3", "-0.3333333333"), ("2/3", "0.6666666667"),
    ("0.1+0.2", "0.3"), ("2**10", "1024"), ("2**-3", "0.125"), ("(1+2)*3 - 4//3 % 2", "8"), ("-(-3)", "3"),
    ("+5", "5"), ("7 % 3", "1"), ("-7 // 2", "-4"), ("1,000 * 3", "3000"), ("3×4−1", "11"), ("12 ÷ 5", "2.4"),
    ("2^8", "256"), ("  48 / 4 ", "12"), ("1e3 * 2", "2000"), ("(((((2)))))", "2"), ("10**-3", "0.001"),
    ("123456789 * 987654321", "121932631112635269"),
])
def test_calculator_values(expr, value):
    assert calc(expr) == ("ok", value)


@pytest.mark.parametrize("expr, message", [
    ("1/0", "division by zero"), ("5 % 0", "division by zero"), ("0 ** -1", "division by zero"),
    ("", "empty expression"), ("2 +", "invalid expression"), ("2 ** 0.5", "only integer exponents"),
    ("2 ** 5000", "exponent larger than 1024"), ("9 ** 9 ** 9", "exponent larger"),
    ("99999 ** 1000", "result larger than 4000 digits"), ("True + 1", "only numbers"), ("'a' * 3", "only numbers"),
    ("1j * 2", "only numbers"), ("x + 1", "Name is not allowed"), ("abs(-1)", "Call is not allowed"),
    ("__import__('os').system('echo hi')", "Call is not allowed"), ("(1).real", "Attribute is not allowed"),
    ("[1, 2]", "List is not allowed"), ("1 < 2", "Compare is not allowed"), ("1 if 1 else 2", "IfExp is not allowed"),
    ("(lambda: 1)()", "not allowed"), ("1 << 100", "operator LShift is not allowed"), ("1; 2", "invalid expression"),
    ("1 and 2", "BoolOp is not allowed"),
])
def test_calculator_rejects_with_an_error_text(expr, message):
    status, out = calc(expr)
    assert status == "error" and out.startswith("error: ") and message in out, out


def test_calculator_bounds_make_every_call_cheap():
    # each of these would take seconds or gigabytes with eval(); the bounds refuse them up front
    for expr in ("10 ** 1000 * 10 ** 1000 * 10 ** 1000 * 10 ** 1000 * 10 ** 1000",
                 "(10 ** 999) ** 1000", "2 ** 1024 ** 2", "((((((((((((((((((((((((((9**9))))))))))))))))))))))))))**999",
                 "9" * 600, "(" * 300 + "1" + ")" * 300, "+".join(["1"] * 200)):
        t0 = time.perf_counter()
        status, out = calc(expr)
        assert time.perf_counter() - t0 < 0.5, expr[:40]
        assert status == "error", (expr[:40], out)
    assert calc("+".join(["1"] * 100)) == ("ok", "100")  # long chains within the bounds are fine
    assert calc("2 ** 64", max_digits=10)[0] == "error" and calc("2 ** 30", max_digits=10) == ("ok", "1073741824")


def test_calculator_arguments():
    tool = Calculator()
    assert asyncio.run(tool.run({"expr": "1+1"})).output == "error: missing argument 'expression'"
    assert asyncio.run(tool.run({"expression": "1", "x": 2})).output == "error: unknown argument(s) 'x'"
    assert asyncio.run(tool.run({"expression": 12})).output.startswith("error: the expression must be a string")
    assert asyncio.run(tool.run(["1+1"])).output == "error: arguments must be a JSON object, got list"


def test_format_number():
    assert format_number(Fraction(17834)) == "17834"
    assert format_number(Fraction(-1, 8)) == "-0.125"
    assert format_number(Fraction(1, 3), 3) == "0.333"
    assert format_number(Fraction(-1, 3000), 3) == "0"  # no "-0"
    assert format_number(Fraction(5, 2), 0) == "2.5"  # terminating values are always exact


def test_calculator_is_registered_with_schema():
    reg = get_registry()
    assert reg.get("tool", "calculator") is Calculator
    schema = Calculator.schema()
    assert schema["function"]["name"] == "calculator" and schema["function"]["parameters"]["required"] == ["expression"]
    assert "arithmetic" in schema["function"]["description"]
    with pytest.raises(ValidationError):
        CalculatorConfig(max_exponent=-1)
    with pytest.raises(ValidationError):
        CalculatorConfig(unknown=1)


# ----------------------------------------------------------------------------- Tool.run
class SlowSync(Tool):
    """Sleeps (a blocking call) then answers."""

    name: ClassVar[str] = "slow_sync"
    started = threading.Event()

    def call(self, arguments):
        self.started.set()
        time.sleep(arguments.get("s", 0))
        return "slept"


class SlowAsync(Tool):
    """Awaits then answers; counts how many run at once."""

    name: ClassVar[str] = "slow_async"

    def __init__(self, config=None):
        super().__init__(config)
        self.running = self.peak = 0

    async def call(self, arguments):
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(arguments.get("s", 0))
            return {"answer": 42}  # not a string: turned into one
        finally:
            self.running -= 1


class Broken(Tool):
    """Raises."""

    name: ClassVar[str] = "broken"

    def call(self, arguments):
        raise KeyError("boom")


class Chatty(Tool):
    """Returns a lot of text, or a flagged failure."""

    name: ClassVar[str] = "chatty"

    def call(self, arguments):
        if arguments.get("fail"):
            return ToolOutput("it did not work", ok=False)
        return "x" * 10_000


def test_sync_tool_runs_in_a_thread_and_times_out_without_blocking_the_loop():
    tool = SlowSync(ToolConfig(timeout_s=0.2))

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.ensure_future(ticker())
        res = await tool.run({"s": 2})
        t.cancel()
        return res, ticks

    t0 = time.perf_counter()
    res, ticks = asyncio.run(main())
    assert res.status == "timeout" and res.output == "error: slow_sync timed out after 0.2s"
    assert time.perf_counter() - t0 < 1.5 and ticks >= 5  # the event loop kept running meanwhile
    assert asyncio.run(SlowSync(ToolConfig(timeout_s=2)).run({"s": 0})).output == "slept"


def test_async_tool_timeout_and_concurrency_limit():
    slow = SlowAsync(ToolConfig(timeout_s=0.1))
    r = asyncio.run(slow.run({"s": 5}))
    assert r.status == "timeout" and slow.running == 0  # cancelled, and its finally ran
    limited = SlowAsync(ToolConfig(max_concurrency=2))

    async def many():
        return await asyncio.gather(*(limited.run({"s": 0.02}) for _ in range(7)))

    results = asyncio.run(many())
    assert [r.output for r in results] == ["{'answer': 42}"] * 7 and limited.peak == 2
    assert asyncio.run(many()) and limited.peak == 2  # a second event loop gets its own semaphore


def test_errors_become_text_and_output_is_truncated():
    r = asyncio.run(Broken().run({}))
    assert r.status == "error" and r.output == "error: KeyError: 'boom'"
    long = asyncio.run(Chatty(ToolConfig(max_output_chars=100)).run({}))
    kept = long.output.index("...[truncated")
    assert long.status == "ok" and len(long.output) == 100 and long.output[:kept] == "x" * kept
    assert long.output.endswith(f"...[truncated {10_000 - kept} chars]")
    failed = asyncio.run(Chatty().run({"fail": True}))
    assert failed.status == "error" and failed.output == "it did not work"


def test_third_party_tools_register_through_the_hook():
    class Plugin:
        @staticmethod
        @hookimpl
        def register_tools():
            return [Broken]

    reg = registry_with(Plugin)
    assert reg.get("tool", "broken") is Broken and reg.entry("tool", "broken").dist == "<inline>"
    assert reg.entry("tool", "calculator").description.startswith("Evaluates an arithmetic expression")
