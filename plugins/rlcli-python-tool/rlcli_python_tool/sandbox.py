"""Run untrusted Python code in a child interpreter with limits, and report what happened.

:func:`run_python` writes the code to ``main.py`` in a fresh temporary directory and runs
``python -I -S`` (isolated mode: no ``PYTHON*`` variables, no user or site packages - the
standard library only) with that directory as its working directory and a scrubbed environment
(``PATH``, ``HOME``/``TMPDIR`` = the directory, ``LANG``). The directory is deleted afterwards.

**What is enforced, and by what.**

* *Kernel limits* (``setrlimit`` in the child, soft = hard, so they cannot be raised again):
  CPU seconds (``SIGXCPU``, then ``SIGKILL``), address space (a huge allocation raises
  ``MemoryError``), file size (writing past it fails with ``EFBIG``), open files, core dumps
  (none), and ``RLIMIT_NPROC`` (new processes/threads; note that Linux does not apply it to
  root).
* *Wall clock*: the child runs in its own session; when the timeout expires the whole process
  group is killed (``SIGKILL``), so nothing it started survives.
* *Namespaces* (``network: auto`` uses them when ``unshare --user --map-root-user --net`` works
  on the machine, ``namespace`` requires them): a network namespace with no usable interface -
  no network at all, whatever the code does. In the user namespace device nodes cannot be
  created either.
* *An audit hook* (``sys.addaudithook``, installed before the code runs and impossible to
  remove from Python) that denies, with ``PermissionError`` and a ``[sandbox] denied ...`` line
  on stderr: opening files outside the sandbox directory, except *reading* regular files of the
  standard library (imports, tracebacks); listing or changing anything outside it; links;
  ``os.system``, ``exec*``, ``fork``, ``posix_spawn``, ``subprocess`` and signals to other
  processes; sockets, and importing ``socket``, ``ssl``, ``subprocess``, ``multiprocessing``,
  ``ctypes`` and a few other modules that reach around the policy; raising limits; building
  code objects by hand; and the introspection that could reach the hook itself (``gc``
  referrers, tracing). Paths must be ``str``/``bytes`` (a ``pathlib.Path`` is refused: its
  ``__fspath__`` could answer differently to the check and to the open).

**What is not guaranteed.** The audit hook runs inside the sandboxed interpreter: code that
corrupts the interpreter (for instance crafted bytecode fed through ``marshal``) could get past
it, and then only the kernel limits, the process-group kill and - where available - the
namespaces remain; files readable and writable by the user running rlcli would then be exposed.
``os.stat``/``os.path.exists`` outside the sandbox are not audited (existence can be probed,
contents cannot be read). Without namespaces, "no network" rests on the audit hook alone, and
when rlcli runs as root ``RLIMIT_NPROC`` is not enforced, so a fork bomb is stopped by the hook
(fork is denied) and, failing that, by the process-group kill at the timeout. Treat this as a
guard against accidents and careless model-written code in RL rollouts, not as a boundary
against a determined attacker: for that, run rollouts in a container or VM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

BOOTSTRAP = (Path(__file__).with_name("_bootstrap.py")).read_text(encoding="utf-8")
"""The child's first code: limits, audit hook, then ``exec`` of main.py (see ``_bootstrap.py``)."""

Status = Literal["ok", "error", "denied", "timeout", "cpu_limit", "memory_limit", "killed", "sandbox_error"]
NetworkMode = Literal["auto", "namespace", "audit"]

_UNSHARE_ARGS = ["--user", "--map-root-user", "--net"]  # unshare then execs python: same pid, true exit status


@dataclass
class Limits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512
    file_mb: int = 16
    open_files: int = 64
    processes: int = 0
    output_bytes: int = 65536  # per stream; the rest is read and dropped

    def for_child(self) -> dict:
        return {"cpu_s": self.cpu_s, "memory_bytes": self.memory_mb << 20, "file_bytes": self.file_mb << 20,
                "open_files": self.open_files, "processes": self.processes}


@dataclass
class SandboxResult:
    status: Status
    exit_code: int | None
    stdout: str
    stderr: str
    elapsed_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    denied: list[str] = field(default_factory=list)  # "[sandbox] denied ..." lines
    namespaces: bool = False  # ran in user + network namespaces

    @property
    def ok(self) -> bool:
        return self.status == "ok"


_NAMESPACES_OK: dict[str, bool] = {}


def namespaces_available(unshare: str | None = None) -> bool:
    """Whether ``unshare`` can make user and network namespaces here (probed once per binary)."""
    unshare = unshare or shutil.which("unshare")
    if not unshare or not sys.platform.startswith("linux"):
        return False
    if unshare not in _NAMESPACES_OK:
        try:
            r = subprocess.run([unshare, *_UNSHARE_ARGS, "--", "true"], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10)
            _NAMESPACES_OK[unshare] = r.returncode == 0
        except (OSError, subprocess.SubprocessError):
            _NAMESPACES_OK[unshare] = False
    return _NAMESPACES_OK[unshare]


class _Capture:
    """Reads a stream to its end, keeping the first ``limit`` bytes (the rest is drained and
    dropped, so the child never blocks on a full pipe); what was kept survives a cancellation."""

    def __init__(self, limit: int):
        self.limit, self.data, self.truncated = limit, bytearray(), False

    async def read(self, stream: asyncio.StreamReader) -> None:
        while True:
            chunk = await stream.read(65536)
            if not chunk:
                return
            room = self.limit - len(self.data)
            if room > 0:
                self.data += chunk[:room]
            if len(chunk) > room:
                self.truncated = True

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def run_python(code: str, limits: Limits | None = None, *, python: str | None = None,
                     network: NetworkMode = "auto") -> SandboxResult:
    """Run ``code`` under the sandbox described in the module docstring; never raises for bad code."""
    limits = limits or Limits()
    python = python or sys.executable
    use_ns = network == "namespace" or (network == "auto" and namespaces_available())
    if network == "namespace" and not namespaces_available():
        return SandboxResult("sandbox_error", None, "", "network: namespace was requested but `unshare --user "
                             "--map-root-user --net` does not work on this machine", 0.0)
    root = tempfile.mkdtemp(prefix="rlcli-py-")
    t0 = time.perf_counter()
    proc = readers = None
    try:
        Path(root, "main.py").write_text(code, encoding="utf-8")
        cmd = [python, "-I", "-S", "-c", BOOTSTRAP, root, json.dumps(limits.for_child())]
        if use_ns:
            cmd = [shutil.which("unshare") or "unshare", *_UNSHARE_ARGS, "--", *cmd]
        env = {"PATH": "/usr/bin:/bin", "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            cwd=root, env=env, start_new_session=True, close_fds=True)
        out, err = _Capture(limits.output_bytes), _Capture(limits.output_bytes)
        readers = asyncio.ensure_future(asyncio.gather(out.read(proc.stdout), err.read(proc.stderr)))
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(readers), limits.wall_s)
            rc = await asyncio.wait_for(proc.wait(), max(0.1, limits.wall_s - (time.perf_counter() - t0)))
        except asyncio.TimeoutError:
            timed_out = True
            _kill_group(proc.pid)
            rc = await proc.wait()
        _kill_group(proc.pid)  # anything the code left running in its group
        try:  # the pipes close when the last process holding them is gone
            await asyncio.wait_for(asyncio.shield(readers), 2.0)
        except asyncio.TimeoutError:
            readers.cancel()
        elapsed = time.perf_counter() - t0
        stderr = err.text()
        denied = [line[len("[sandbox] denied "):] for line in stderr.splitlines() if line.startswith("[sandbox] denied ")]
        status = _status(rc, timed_out, stderr)
        if status == "error" and denied:
            status = "denied"  # it failed on something the sandbox refused
        return SandboxResult(status, rc, out.text(), stderr, elapsed, out.truncated, err.truncated, denied, use_ns)
    except asyncio.CancelledError:
        if proc is not None and proc.returncode is None:
            _kill_group(proc.pid)
        raise
    except OSError as exc:
        return SandboxResult("sandbox_error", None, "", f"could not start the sandbox: {exc}",
                             time.perf_counter() - t0)
    finally:
        if proc is not None and proc.returncode is None:
            _kill_group(proc.pid)
        if readers is not None and not readers.done():
            readers.cancel()
        shutil.rmtree(root, ignore_errors=True)


def _status(rc: int | None, timed_out: bool, stderr: str) -> Status:
    if timed_out:
        return "timeout"
    if rc == 0:
        return "ok"
    if rc is not None and rc < 0:
        sig = -rc
        if sig == signal.SIGXCPU:
            return "cpu_limit"
        return "killed"
    if rc == 70 and "[sandbox] cannot set" in stderr:
        return "sandbox_error"
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if last.startswith("MemoryError"):
        return "memory_limit"
    return "error"
