"""rlcli plugin: ``python``, a tool that runs model-written Python code in a sandbox.

The model sends ``{"code": "..."}``; the code runs in a separate ``python -I -S`` process in a
fresh temporary directory with CPU, memory, file-size, open-file and process limits, a
wall-clock timeout that kills its whole process group, and kernel layers (namespaces with
read-only mounts, Landlock, seccomp) under an audit-hook policy on files and processes (what is
guaranteed on which kernel: the plugin's README and :mod:`rlcli_python_tool.sandbox`). The
tool's output is what the code printed; a failure adds its status and stderr::

    [status: error, exit code 1]
    ...stdout...
    [stderr]
    Traceback (most recent call last): ...
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from rlcli import hookimpl
from rlcli.tools import Tool, ToolConfig, ToolOutput
from rlcli_python_tool._kernel import _boundary_missing
from rlcli_python_tool.sandbox import (
    Limits,
    SandboxResult,
    Strict,
    kernel_layers,
    namespaces_available,
    run_python,
    strictness,
)

__all__ = ["PythonTool", "PythonToolConfig", "Limits", "SandboxResult", "run_python", "namespaces_available",
           "kernel_layers", "format_result"]
__version__ = "0.1.0"


class PythonToolConfig(ToolConfig):
    timeout_s: float = Field(10.0, gt=0, description="Wall-clock limit per call; the process group is killed after it.")
    max_output_chars: int = Field(2000, gt=0, description="Longer tool output (stdout and stderr) is cut to this.")
    max_concurrency: int | None = Field(
        default_factory=lambda: max(1, os.cpu_count() or 1), gt=0,
        description="Sandboxes running at once (default: the number of CPUs).")
    cpu_time_s: int = Field(5, gt=0, description="CPU seconds (RLIMIT_CPU).")
    memory_mb: int = Field(512, gt=0, description="Address space in MiB (RLIMIT_AS); a larger allocation raises MemoryError.")
    file_size_mb: int = Field(16, ge=0, description="Largest file the code may write, in MiB (RLIMIT_FSIZE).")
    open_files: int = Field(64, gt=3, description="Open file descriptors (RLIMIT_NOFILE).")
    processes: int = Field(
        0, ge=0, description="RLIMIT_NPROC: processes and threads the user may have (0: none new; not enforced for "
        "root). New processes are refused anyway (seccomp, audit hook): this bounds threads.")
    network: Literal["auto", "namespace", "audit"] = Field(
        "auto", description="auto: user, mount, network and IPC namespaces (no network, read-only filesystem, a "
        "private folder) when `unshare` works here; namespace: require them; audit: never use them.")
    disk_mb: int = Field(
        64, gt=0, description="Size of the code's folder in MiB (a private tmpfs where namespaces work).")
    strict: Strict = Field(
        "boundary", description="Which missing kernel layers make the tool refuse to run (rlcli validate and train "
        "then exit 2 naming them). boundary: Landlock or the seccomp filter, the layers that hold against hostile "
        "code (files; processes, programs, sockets, signals); all: any layer (namespaces, Landlock ABI 6 - "
        "Linux 6.12+ - and seccomp); off: none, run with the layers there are. A missing layer that is not "
        "refused is logged once; what it enforced then rests on the in-process audit hook, which is no "
        "boundary against code written to get past it. true/false mean all/off.")

    @field_validator("strict", mode="before")
    @classmethod
    def _strict_bool(cls, v: Any) -> Any:
        return strictness(v) if isinstance(v, bool) else v

    python: str | None = Field(None, description="Interpreter to run the code with (default: the one running rlcli).")


def format_result(r: SandboxResult, limit: int) -> ToolOutput:
    """The tool output for one run: stdout alone on success, else status, stdout and stderr."""
    if r.ok and not r.stderr.strip():
        text = r.stdout + ("\n[output truncated]" if r.stdout_truncated else "")
        return ToolOutput(text if text.strip() else "[no output]", ok=True)
    head = f"[status: {r.status}" + (f", exit code {r.exit_code}" if r.exit_code is not None else "") + "]"
    stderr = r.stderr
    if len(stderr) > limit // 2:  # keep the end of a traceback: the exception is there
        stderr = "..." + stderr[-(limit // 2):]
    parts = [head]
    if r.stdout:
        parts.append(r.stdout.rstrip("\n") + ("\n[output truncated]" if r.stdout_truncated else ""))
    if stderr.strip():
        parts += ["[stderr]", stderr.rstrip("\n")]
    return ToolOutput("\n".join(parts), ok=r.ok)


class PythonTool(Tool):
    """Runs Python code in a sandboxed subprocess and returns what it printed."""

    name: ClassVar[str] = "python"
    Config: ClassVar[type[PythonToolConfig]] = PythonToolConfig
    config: PythonToolConfig
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python 3 source; print() what you need to see."}},
        "required": ["code"],
    }

    @classmethod
    def check_config(cls, cfg: PythonToolConfig) -> list[tuple[str, str]]:
        """The kernel layers ``strict`` asks for must hold on this machine (probed once)."""
        if cfg.strict == "off":
            return []
        if cfg.strict == "all" and cfg.network == "audit":
            return [("network", "strict: all needs the namespaces, which network: audit turns off; "
                                "use network: auto or namespace")]
        probe = kernel_layers(cfg.python, cfg.network)
        if probe.status != "ok":
            return [("strict", f"the sandbox could not run here: {probe.stderr.strip()[-500:]}")]
        missing = probe.missing if cfg.strict == "all" else _boundary_missing(probe.layers)
        if missing:
            fix = ("Run on Linux 6.12+ with unprivileged user namespaces, or set strict: boundary (Landlock and "
                   "seccomp only)" if cfg.strict == "all" else "Run on Linux 5.13+ with Landlock enabled (x86_64 "
                   "or aarch64), or set strict: off to run without them where no hostile code runs")
            return [("strict", f"this machine lacks kernel layers strict: {cfg.strict} asks for: "
                     + "; ".join(missing) + f". {fix} (a warning is logged)")]
        return []

    def limits(self) -> Limits:
        c = self.config
        return Limits(cpu_s=c.cpu_time_s, wall_s=c.timeout_s, memory_mb=c.memory_mb, file_mb=c.file_size_mb,
                      open_files=c.open_files, processes=c.processes, output_bytes=max(4096, 4 * c.max_output_chars),
                      disk_mb=c.disk_mb)

    def run_timeout_s(self) -> float:
        return self.config.timeout_s + 5.0  # the sandbox kills at timeout_s and reports what it has

    async def execute(self, code: str) -> SandboxResult:
        """Run ``code`` in the sandbox and return the full result (for callers other than agent loops)."""
        c = self.config
        return await run_python(code, self.limits(), python=c.python, network=c.network, strict=c.strict)

    async def call(self, arguments: dict[str, Any]) -> ToolOutput:
        code = arguments.get("code")
        unknown = sorted(set(arguments) - {"code"})
        if not isinstance(code, str):
            return ToolOutput("error: argument 'code' (a string of Python source) is required", ok=False)
        if unknown:
            return ToolOutput(f"error: unknown argument(s) {', '.join(map(repr, unknown))}", ok=False)
        result = await self.execute(code)
        if result.status == "sandbox_error":  # the sandbox itself could not run: not the model's fault
            raise RuntimeError(result.stderr)
        return format_result(result, self.config.max_output_chars)


@hookimpl
def register_tools():
    return [PythonTool]
