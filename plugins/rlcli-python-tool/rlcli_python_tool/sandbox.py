"""Run untrusted Python code in a child interpreter with limits, and report what happened.

:func:`run_python` writes the code to ``main.py`` in a fresh temporary directory (the folder) and
runs ``python -I -S`` (isolated mode: no ``PYTHON*`` variables, no user or site packages - the
standard library only) there with a scrubbed environment (``PATH``, ``HOME``/``TMPDIR`` = the
folder, ``LANG``). The directory is deleted afterwards.

**What is enforced, and by what** (the plugin's README has the full table, per kernel):

* *Resource limits* (``setrlimit`` in the child, soft = hard): CPU seconds, address space,
  file size, open files, no core dumps, ``RLIMIT_NPROC``, no real-time or raised priority; and
  the wall clock: the child runs in its own session and its whole process group is killed when
  the timeout expires. The child dies with this process (``PR_SET_PDEATHSIG``, also when it is
  SIGKILLed) and its ``oom_score_adj`` is 1000 (the OOM killer takes it before the trainer).
* *Kernel layers*, applied by the child before the code runs (``_kernel.py``), each where the
  kernel offers it: user, mount, network and IPC namespaces (``unshare``) in which every mount is
  read-only and the folder is a private tmpfs of ``disk_mb``; no capabilities; Landlock (reads
  only of the folder and the interpreter's and C libraries' files, writes only in the folder, no
  TCP, and - ABI 6 - signals and abstract unix sockets only within the sandbox); a seccomp filter
  (no new processes, programs or sockets; signals, priority, scheduling and limits only of the
  sandbox itself; no tracing, no io_uring, no mounts). Which layers held is in
  :attr:`SandboxResult.layers`; a missing one is logged once (``strict`` refuses to run instead).
* *An audit hook* (``sys.addaudithook``, installed last) that denies, with ``PermissionError``
  and a ``[sandbox] denied ...`` line on stderr, what the policy forbids before the kernel has
  to: files outside the folder (reading regular files of the standard library is allowed),
  links, ``chdir`` out, processes, signals, sockets, ``ctypes`` and other modules that reach
  around the policy, raising limits, hand-made code objects and the introspection that could
  reach the hook itself. It runs inside the sandboxed interpreter, so it is a first line and a
  source of clear messages, **not a security boundary**: code that reads and writes native
  memory (the ctypes types the child loads to apply the kernel layers stay reachable from pure
  Python) switches it off. Against hostile code, the kernel layers are the boundary; where one
  is missing, what it enforced is lost (:attr:`SandboxResult.missing` says what).

The status is taken from what the code cannot fake by printing: the parent's own clock
(``timeout``), the signal that ended the child (``cpu_limit``, ``killed``), the bootstrap's refusal
before any code ran (``sandbox_error``), and the exit status the bootstrap sets for an uncaught
exception (``denied``: 77, a denial of the audit hook; ``memory_limit``: 71, a MemoryError).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
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

from rlcli_python_tool._kernel import _missing_layers

_HERE = Path(__file__).parent
BOOTSTRAP = (_HERE / "_kernel.py").read_text(encoding="utf-8") + "\n" + (_HERE / "_bootstrap.py").read_text(encoding="utf-8")
"""The child's first code: limits, kernel layers, audit hook, then ``exec`` of main.py."""

Status = Literal["ok", "error", "denied", "timeout", "cpu_limit", "memory_limit", "killed", "sandbox_error"]
NetworkMode = Literal["auto", "namespace", "audit"]
# Which missing kernel layers make the sandbox refuse to run: ``all`` (every layer), ``boundary``
# (Landlock or seccomp: the layers that hold against hostile code), ``off`` (none: run, log once).
Strict = Literal["all", "boundary", "off"]


def strictness(strict: "Strict | bool") -> Strict:
    """``strict`` as one of :data:`Strict` (``True``/``False``: ``all``/``off``, as before ``boundary``)."""
    if isinstance(strict, bool):
        return "all" if strict else "off"
    if strict not in ("all", "boundary", "off"):
        raise ValueError(f"strict must be all, boundary or off (or true/false), not {strict!r}")
    return strict

log = logging.getLogger("rlcli.python_tool")

# unshare then execs python: same pid (the session leader, whose parent is this process: it dies
# with it), true exit status
_UNSHARE_ARGS = ["--user", "--map-root-user", "--net", "--mount", "--ipc"]
_LAYERS_LINE = "[sandbox] layers "
# exit statuses of the bootstrap (_bootstrap.py): it refused to run the code; the code died of an
# uncaught denial of the audit hook (EX_NOPERM); of an uncaught MemoryError
_EXIT_REFUSED, _EXIT_DENIED, _EXIT_MEMORY = 70, 77, 71


@dataclass
class Limits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512
    file_mb: int = 16
    open_files: int = 64
    processes: int = 0
    output_bytes: int = 65536  # per stream; the rest is read and dropped
    disk_mb: int = 64  # the folder's size, where it is a private tmpfs (namespaces)

    def for_child(self) -> dict:
        return {"cpu_s": self.cpu_s, "memory_bytes": self.memory_mb << 20, "file_bytes": self.file_mb << 20,
                "open_files": self.open_files, "processes": self.processes, "disk_bytes": self.disk_mb << 20,
                "inodes": 1024 + 256 * self.disk_mb}


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
    namespaces: bool = False  # ran in user, mount, network and IPC namespaces
    layers: dict = field(default_factory=dict)  # the kernel layers in force (see _kernel.py); {} if it never ran

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def missing(self) -> list[str]:
        """What does not hold for want of a kernel layer, one line each."""
        return _missing_layers(self.layers) if self.layers else []


_NAMESPACES_OK: dict[str, bool] = {}


def namespaces_available(unshare: str | None = None) -> bool:
    """Whether ``unshare`` can make user, mount, network and IPC namespaces here (probed once per binary)."""
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


def _command(root: str, limits: Limits, python: str, use_ns: bool, strict: Strict, audit_hook: bool,
             without: tuple[str, ...] = (), parent: int | None = None):
    """The child's command line and environment; ``parent``: the pid the child dies with (this process)."""
    opts = dict(limits.for_child(), namespaces=use_ns, strict=strictness(strict), audit_hook=audit_hook,
                without=list(without),
                parent=os.getpid() if parent is None else parent)
    cmd = [python, "-I", "-S", "-c", BOOTSTRAP, root, json.dumps(opts)]
    if use_ns:
        cmd = [shutil.which("unshare") or "unshare", *_UNSHARE_ARGS, "--", *cmd]
    env = {"PATH": "/usr/bin:/bin", "HOME": root, "TMPDIR": root, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
    return cmd, env


def _split_layers(stderr: str) -> tuple[dict, str]:
    """The bootstrap's report (its first stderr line, written before the code ran) and the rest."""
    if not stderr.startswith(_LAYERS_LINE):
        return {}, stderr
    line, _, rest = stderr.partition("\n")
    try:
        return json.loads(line[len(_LAYERS_LINE):]), rest
    except ValueError:
        return {}, stderr


_PROBED: dict[tuple[str, bool], SandboxResult] = {}


def kernel_layers(python: str | None = None, network: NetworkMode = "auto") -> SandboxResult:
    """Run ``pass`` in the sandbox once (per interpreter and namespace use) and return the result:
    its ``layers`` and ``missing`` say what this machine enforces. Synchronous, for recipe checks."""
    python = python or sys.executable
    use_ns = network == "namespace" or (network == "auto" and namespaces_available())
    key = (python, use_ns)
    if key not in _PROBED:
        with tempfile.TemporaryDirectory(prefix="rlcli-py-") as root:
            Path(root, "main.py").write_text("pass", encoding="utf-8")
            cmd, env = _command(root, Limits(), python, use_ns, False, True)
            try:
                r = subprocess.run(cmd, cwd=root, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                   timeout=60, start_new_session=True)
                layers, stderr = _split_layers(r.stderr.decode("utf-8", "replace"))
                _PROBED[key] = SandboxResult(_status(r.returncode, False, stderr, bool(layers)), r.returncode, "",
                                             stderr, 0.0, namespaces=use_ns, layers=layers)
            except (OSError, subprocess.SubprocessError) as exc:
                return SandboxResult("sandbox_error", None, "", f"could not start the sandbox: {exc}", 0.0)
    return _PROBED[key]


_WARNED: set[tuple[str, ...]] = set()


def _warn_missing(result: SandboxResult) -> None:
    missing = tuple(result.missing)
    if missing and missing not in _WARNED:
        _WARNED.add(missing)
        log.warning("python tool: the sandbox runs without some kernel layers on this machine; what they enforced "
                    "rests on the in-process audit hook, which stops mistakes but not code written to get past it "
                    "(strict: all refuses to run without them): %s", "; ".join(missing))


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
                     network: NetworkMode = "auto", strict: Strict = "off", audit_hook: bool = True,
                     without: tuple[str, ...] = ()) -> SandboxResult:
    """Run ``code`` under the sandbox described in the module docstring; never raises for bad code.

    ``strict``: ``all`` refuses (status ``sandbox_error``) unless every kernel layer holds,
    ``boundary`` unless Landlock and seccomp hold (the tool's default; see :data:`Strict`), ``off``
    never (this function's default, for callers that choose); a missing layer that is not refused is
    logged once. ``True``/``False`` mean ``all``/``off``. For tests of what each part holds alone, never for rollouts:
    ``audit_hook=False`` leaves the audit hook out, ``without`` the named kernel layers
    ("mounts", "landlock", "seccomp").
    """
    limits = limits or Limits()
    python = python or sys.executable
    use_ns = network == "namespace" or (network == "auto" and namespaces_available())
    if network == "namespace" and not namespaces_available():
        return SandboxResult("sandbox_error", None, "", "network: namespace was requested but `unshare "
                             f"{' '.join(_UNSHARE_ARGS)}` does not work on this machine", 0.0)
    root = tempfile.mkdtemp(prefix="rlcli-py-")
    t0 = time.perf_counter()
    proc = readers = None
    try:
        Path(root, "main.py").write_text(code, encoding="utf-8")
        cmd, env = _command(root, limits, python, use_ns, strict, audit_hook, without)
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
        result = _result(rc, timed_out, out, err, time.perf_counter() - t0, use_ns)
        if strictness(strict) != "all" and not without:
            _warn_missing(result)
        return result
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


def _result(rc: int | None, timed_out: bool, out: _Capture, err: _Capture, elapsed: float, use_ns: bool) -> SandboxResult:
    layers, stderr = _split_layers(err.text())
    # the hook's messages, for the reader: the code can write such lines too, so the status never depends on them
    denied = [line[len("[sandbox] denied "):] for line in stderr.splitlines() if line.startswith("[sandbox] denied ")]
    status = _status(rc, timed_out, stderr, bool(layers))
    return SandboxResult(status, rc, out.text(), stderr, elapsed, out.truncated, err.truncated, denied, use_ns, layers)


def _status(rc: int | None, timed_out: bool, stderr: str, ran: bool) -> Status:
    """The status from what printing cannot fake: the parent's clock, the signal, the exit status.

    ``ran``: the bootstrap reported its layers (the first stderr line, written before the code
    ran), so the code itself ran and any exit is its own; before that, an exit of 70 with the
    bootstrap's ``[sandbox] cannot`` line is the sandbox's refusal. After it, 77 and 71 are the
    bootstrap's exit statuses for an uncaught denial and MemoryError (code that exits with them
    itself gets what it asked for; what it prints on stderr changes nothing).
    """
    if timed_out:
        return "timeout"
    if rc == 0:
        return "ok"
    if rc is not None and rc < 0:
        sig = -rc
        if sig == signal.SIGXCPU:
            return "cpu_limit"
        return "killed"
    if not ran:
        return "sandbox_error" if rc == _EXIT_REFUSED and "[sandbox] cannot " in stderr else "error"
    if rc == _EXIT_DENIED:
        return "denied"
    if rc == _EXIT_MEMORY:
        return "memory_limit"
    return "error"
