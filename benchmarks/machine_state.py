"""What else holds the GPU when a benchmark run starts, and a run that leaves nothing behind.

A timed run is only comparable with another when the GPU was its own. Two things have broken that
in past device calls without anything saying so: a process left over from an earlier command of
the same call (an inference engine's worker process outlives a parent killed by ``timeout``), and
a row's own children still running after the row ended. :func:`gpu_state` records who held the
GPU when a run started (``nvidia-smi``; ``None`` where there is none), :func:`host_cpu` which CPU
the host has (leases differ, and a host-bound engine follows it), and :func:`run_alone` runs a
command in a process group of its own and kills whatever of that group is left when it ends or
times out.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

_QUERY_S = 15  # nvidia-smi answers in well under a second; a hung driver must not hang the sweep


def _smi(*args: str) -> list[list[str]] | None:
    try:
        out = subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=_QUERY_S)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


def gpu_state() -> dict | None:
    """The GPUs' memory in use and utilisation, and every compute process on them (pid, name, MiB);
    ``None`` without ``nvidia-smi``."""
    gpus = _smi("--query-gpu=index,memory.used,utilization.gpu")
    if gpus is None:
        return None
    procs = _smi("--query-compute-apps=pid,process_name,used_memory") or []
    return {"gpus": [{"index": g[0], "memory_used_mib": _num(g[1]), "util_pct": _num(g[2])}
                     for g in gpus if len(g) == 3],
            "processes": [{"pid": p[0], "name": p[1], "memory_mib": _num(p[2])} for p in procs if len(p) == 3]}


def host_cpu() -> str:
    """The host's CPU model and core count ('?' where unknown): an engine whose decode step waits on
    its own Python scheduler (vLLM's) should follow one core's speed."""
    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def _num(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None  # "[N/A]"


def foreign_note(state: dict | None) -> str:
    """A table note when the GPU was not free as a run started ('' when it was, or is unknown)."""
    if not state or not state["processes"]:
        return ""
    held = ", ".join(f"{p['name'].rsplit('/', 1)[-1]} ({p['memory_mib']:.0f} MiB)" if p["memory_mib"] is not None
                     else p["name"] for p in state["processes"])
    return f"GPU NOT FREE at start: {held}"


def run_alone(cmd: list[str], *, stdout, env: dict, cwd: str, timeout: float | None) -> tuple[int | str, int]:
    """Run ``cmd`` in a new session; on timeout stop the whole session (SIGTERM, then SIGKILL after
    10 s). Returns its exit code (or ``"timeout"``) and how many processes of its session were still
    alive when it ended, all of which are then killed."""
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
    try:
        rc: int | str = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = "timeout"
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        deadline = time.monotonic() + 5  # the rest of the group got the SIGTERM too: give it time to go
        while _survivors(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    left = _survivors(proc.pid)
    if left:
        _signal_group(proc.pid, signal.SIGKILL)
        time.sleep(0.5)
    return rc, left


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # the group is already gone
        pass


def _survivors(pgid: int) -> int:
    """Processes still in process group ``pgid`` (Linux ``/proc``; 0 elsewhere or when none)."""
    n = 0
    try:
        pids = [d for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            n += 1
    return n
