"""The tool contract: what an agent loop can call by name, and how a call is run safely.

A tool is a registered component (plugin kind ``tool``, hook ``register_tools``) with

* ``name`` - what the model writes in its tool call and what recipes list under ``tools``;
* ``Config`` - a pydantic model, subclass of :class:`ToolConfig` (``timeout_s``,
  ``max_output_chars``, ``max_concurrency``), validated by ``rlcli validate``;
* a docstring whose first line is the tool's description (shown by ``rlcli plugins`` and put
  in tool schemas);
* ``parameters`` - a JSON schema of its arguments (shown to chat models in the system prompt);
* ``call(arguments: dict) -> str`` - plain or ``async``. It may also return a
  :class:`ToolOutput` to report a failure with text (``ToolOutput(text, ok=False)``).

Agent loops never call ``call`` directly: :meth:`Tool.run` applies the per-call timeout,
turns every exception (and a timeout) into tool output text starting with ``error:``,
truncates long output, limits how many calls of one tool run at once, and never raises (other
than ``asyncio.CancelledError``). A synchronous ``call`` runs in a daemon thread, which cannot be
killed: a sync call that hangs past its timeout is abandoned (its thread keeps running until it
returns), so tools that run untrusted or unbounded work must be ``async`` and own their
subprocesses (as the ``python`` tool of ``rlcli-python-tool`` does). Tools whose work is bounded
by construction (the ``calculator``) set ``run_inline = True`` and run on the event loop with no
thread at all.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field

from rlcli.component import Component, ComponentConfig
from rlcli.lockstep import track

ToolStatus = Literal["ok", "error", "timeout"]


class ToolConfig(ComponentConfig):
    """Options every tool has."""

    timeout_s: float = Field(10.0, gt=0, description="Per-call wall-clock limit; a timed-out call returns an error text.")
    max_output_chars: int = Field(4000, gt=0, description="Longer tool output is cut to this many characters.")
    max_concurrency: int | None = Field(
        None, gt=0, description="At most this many calls of this tool run at once (null: no limit).")


@dataclass
class ToolOutput:
    """What ``Tool.call`` may return instead of a plain string, to flag a failed call."""

    text: str
    ok: bool = True


@dataclass
class ToolResult:
    """The outcome of one call, as the agent loop sees it."""

    name: str
    output: str
    status: ToolStatus = "ok"
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def truncate_text(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, ending with how many were dropped."""
    if len(text) <= limit:
        return text
    keep = limit
    for _ in range(4):  # the marker's length depends on the number it shows
        marker = f"...[truncated {len(text) - keep} chars]"
        keep = max(0, limit - len(marker))
    marker = f"...[truncated {len(text) - keep} chars]"
    return text[:keep] + marker if keep + len(marker) <= limit else text[:limit]


def error_text(message: str) -> str:
    return f"error: {message}"


class Tool(Component):
    """Base class of tools (see the module docstring for the contract)."""

    Config: ClassVar[type[ToolConfig]] = ToolConfig
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}
    run_inline: ClassVar[bool] = False  # True: call() is fast and bounded; run it on the event loop

    def __init__(self, config: ToolConfig | None = None):
        super().__init__(config)
        self._semaphores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # ----------------------------------------------------------------------- to override
    def call(self, arguments: dict[str, Any]) -> str | ToolOutput:
        raise NotImplementedError

    def close(self) -> None:  # noqa: B027 - optional
        """Release resources (processes, sessions); called when the agent loop is discarded."""

    def run_timeout_s(self) -> float:
        """The deadline :meth:`run` enforces. A tool that enforces ``timeout_s`` itself (and can
        report more than "timed out", e.g. what was printed so far) returns a little more."""
        return self.config.timeout_s

    # ----------------------------------------------------------------------- description
    @classmethod
    def description(cls) -> str:
        doc = (cls.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""

    @classmethod
    def schema(cls) -> dict[str, Any]:
        """The OpenAI-style function schema of the tool (what chat templates list as tools)."""
        return {"type": "function",
                "function": {"name": cls.name, "description": cls.description(), "parameters": cls.parameters}}

    # ----------------------------------------------------------------------- running
    def _semaphore(self) -> asyncio.Semaphore | None:
        limit = self.config.max_concurrency
        if limit is None:
            return None
        loop = asyncio.get_running_loop()
        sem = self._semaphores.get(loop)
        if sem is None:
            sem = self._semaphores[loop] = asyncio.Semaphore(limit)
        return sem

    async def run(self, arguments: Any) -> ToolResult:
        """Call the tool with the timeout, limits and error handling described above; never raises."""
        cfg = self.config
        t0 = time.perf_counter()
        if not isinstance(arguments, dict):
            return ToolResult(self.name, error_text(f"arguments must be a JSON object, got {type(arguments).__name__}"),
                              "error", 0.0)
        sem = self._semaphore()
        if sem is not None:
            await sem.acquire()
        status: ToolStatus = "ok"
        try:
            out = await self._invoke(arguments, self.run_timeout_s())
        except asyncio.TimeoutError:
            status, out = "timeout", error_text(f"{self.name} timed out after {cfg.timeout_s:g}s")
        except Exception as exc:  # a tool never crashes the rollout
            status, out = "error", error_text(f"{type(exc).__name__}: {exc}")
        finally:
            if sem is not None:
                sem.release()
        if isinstance(out, ToolOutput):
            status, out = ("ok" if out.ok else "error"), out.text
        elif not isinstance(out, str):
            out = str(out)
        return ToolResult(self.name, truncate_text(out, cfg.max_output_chars), status, time.perf_counter() - t0)

    async def _invoke(self, arguments: dict[str, Any], timeout: float) -> Any:
        if inspect.iscoroutinefunction(self.call):
            return await asyncio.wait_for(self.call(arguments), timeout)
        if self.run_inline:
            out = self.call(arguments)
            if inspect.isawaitable(out):
                out = await asyncio.wait_for(out, timeout)
            return out
        return await asyncio.wait_for(_in_daemon_thread(self.call, arguments), timeout)


def _in_daemon_thread(fn, *args) -> asyncio.Future:
    """Run ``fn(*args)`` in a fresh daemon thread; a daemon never blocks interpreter exit."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if fut.done():  # timed out or cancelled meanwhile: the result is dropped
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def target() -> None:
        try:
            value, ok = fn(*args), True
            if inspect.isawaitable(value):
                value = asyncio.run(_await(value))
        except BaseException as exc:  # noqa: BLE001 - delivered to the caller
            value, ok = exc, False
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=target, name="rlcli-tool", daemon=True).start()
    return track(fut)  # a lockstep engine waits for the tool's answer


async def _await(aw):
    return await aw
