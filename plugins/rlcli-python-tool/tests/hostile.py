"""Hostile code for the python tool's sandbox, and the harness that judges each attempt from outside.

An attempt is a snippet that tries one escape; it prints ``ESCAPED`` only when the operation it
tried went through. After each run the :class:`Harness` checks, from the trainer's side, that
nothing happened: the files of an outside directory (names, contents, modes, times, extended
attributes), no file named with the run's token in ``/tmp``, ``/dev/shm`` or the sandbox's parent
directory, the trainer's priority, scheduling, CPU affinity, limits, OOM score and received
signals (SIGUSR1 and SIGURG), a same-user victim process still alive and untouched, nothing arriving on TCP, UDP,
unix or abstract sockets, no secret in the output. Each attempt's verdict is its own list of
problems. The attempts themselves are in ``hostile_attempts.yaml``. Used by ``test_hostile_code.py``;
kept apart so that the same attempts can be run against another version of the sandbox.
"""

from __future__ import annotations

import dataclasses
import dbm.dumb
import glob
import hashlib
import os
import resource
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Callable

import yaml

from rlcli_python_tool import Limits, SandboxResult

FAST = Limits(cpu_s=2, wall_s=8.0, memory_mb=256, file_mb=4, open_files=32, disk_mb=8)

# Kernel layers that contain an attempt without the audit hook: any one of (layer, lowest value).
READS = (("landlock", 1),)
WRITES = (("landlock", 1), ("mounts", True))
META = (("mounts", True), ("seccomp", True))  # chmod, utime, xattrs: Landlock does not cover them
TRUNCATE = (("landlock", 3), ("mounts", True))
SIGNALS = (("landlock", 6), ("seccomp", True))
OTHERS = (("seccomp", True),)  # priority, scheduling, limits of other processes; new processes; sockets
TRACE = (("landlock", 1), ("seccomp", True))  # Landlock also refuses ptrace outside its domain
NET = (("seccomp", True), ("mounts", True))  # no socket at all, or a network namespace without interfaces
DISK = (("mounts", True),)  # the folder is a tmpfs of disk_mb
ALWAYS = ()


@dataclass(frozen=True)
class Attempt:
    name: str
    code: str  # a string.Template: $outside, $secret, $existing, $db, $victim, $victim_pg, $token, ... (values())
    needs: tuple = ALWAYS  # kernel layers that contain it on their own (any one of them)
    hook: bool = True  # the audit hook stops it too (so the shipped sandbox contains it on any kernel)
    limits: Limits | None = None  # FAST
    expect: Callable[[SandboxResult], str | None] | None = None  # an extra check of the result


def _status_in(*statuses: str) -> Callable[[SandboxResult], str | None]:
    def check(r: SandboxResult) -> str | None:
        return None if r.status in statuses else f"status {r.status}, expected one of {statuses}"
    return check


def _count_at_most(n: int) -> Callable[[SandboxResult], str | None]:
    def check(r: SandboxResult) -> str | None:
        counts = [int(x) for x in r.stdout.split() if x.isdigit()]
        if not counts:
            return f"no count printed (status {r.status}): {r.stderr.strip()[-300:]}"
        return None if counts[-1] <= n else f"got to {counts[-1]}, more than {n}"
    return check


_NEEDS = {"reads": READS, "writes": WRITES, "metadata": META, "truncate": TRUNCATE, "signals": SIGNALS,
          "others": OTHERS, "trace": TRACE, "network": NET, "disk": DISK}


def _attempt(entry: dict) -> Attempt:
    expect = entry.get("expect") or {}
    check = (_status_in(*expect["status"]) if "status" in expect
             else _count_at_most(expect["count_at_most"]) if "count_at_most" in expect else None)
    limits = dataclasses.replace(FAST, **entry["limits"]) if "limits" in entry else None
    return Attempt(entry["name"], entry["code"], _NEEDS[entry["needs"]] if "needs" in entry else ALWAYS,
                   entry.get("hook", True), limits, check)


ATTEMPTS: list[Attempt] = [_attempt(e) for e in yaml.safe_load(
    (Path(__file__).with_name("hostile_attempts.yaml")).read_text(encoding="utf-8"))]


def skip_reason(attempt: Attempt, layers: dict, audit_hook: bool) -> str | None:
    """Why ``attempt`` cannot be judged with these kernel layers (None: it can)."""
    if audit_hook and attempt.hook or not attempt.needs:
        return None
    if any(layers.get(name, 0) >= level for name, level in attempt.needs):
        return None
    wanted = " or ".join(f"{name} >= {level}" if level is not True else name for name, level in attempt.needs)
    return (f"{attempt.name}: contained only by a kernel layer this machine lacks ({wanted}); "
            f"here: {dict((k, v) for k, v in layers.items() if k != 'problems')}")


# errors that mean the snippet itself is wrong, or its target missing here: a vacuous "contained"
_BROKEN = ("SyntaxError", "NameError", "TypeError", "AttributeError", "ModuleNotFoundError", "FileNotFoundError",
           "KeyError", "IndexError", "UnboundLocalError", "IsADirectoryError", "NotADirectoryError")


def _changes(before: dict, after: dict) -> list[str]:
    out = []
    for key in before:
        b, a = before[key], after[key]
        if isinstance(b, dict) and isinstance(a, dict):
            out += [f"{key}: {name} {b.get(name, 'absent')} -> {a.get(name, 'absent')}"
                    for name in sorted(set(b) | set(a)) if b.get(name) != a.get(name)]
        elif b != a:
            out.append(f"{key}: {b} -> {a}")
    return out


class Harness:
    """The outside world an attempt may not touch, and the checks that it did not."""

    def __init__(self, base: Path):
        self.outside, self.secret_text, self.signals = base / "outside", "SECRET-" + secrets.token_hex(8), []
        self._populate()
        (base / "sockets").mkdir()
        self.unix_path = str(base / "sockets" / "sock")
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind(self.unix_path)
        self.unix.listen()
        self.abstract_name = "rlcli-hostile-" + secrets.token_hex(6)
        self.abstract = socket.socket(socket.AF_UNIX)
        self.abstract.bind("\0" + self.abstract_name)
        self.abstract.listen()
        for s in (self.tcp, self.udp, self.unix, self.abstract):
            s.setblocking(False)
        self.victim = self._start_victim()
        self._old_handlers = {sig: signal.signal(sig, lambda n, _: self.signals.append(n))
                              for sig in (signal.SIGUSR1, signal.SIGURG)}
        self.trainer_before = self._trainer()

    def _populate(self) -> None:
        o = self.outside
        (o / "sub").mkdir(parents=True)
        (o / "sub" / "keep.txt").write_text("keep")
        (o / "secret.txt").write_text(self.secret_text)
        (o / "existing.txt").write_text("existing")
        c = sqlite3.connect(o / "data.db")
        c.execute("create table t(x)")
        c.execute("insert into t values (?)", (self.secret_text,))
        c.commit()
        c.close()
        with dbm.dumb.open(str(o / "kv"), "c") as d:
            d[b"k"] = self.secret_text.encode()

    @staticmethod
    def _start_victim() -> subprocess.Popen:
        return subprocess.Popen(["sleep", "600"], start_new_session=True)

    def close(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self.victim.kill()
        self.victim.wait()
        for s in (self.tcp, self.udp, self.unix, self.abstract):
            s.close()

    def values(self, token: str) -> dict:
        o = self.outside
        return {"outside": str(o), "secret": str(o / "secret.txt"), "existing": str(o / "existing.txt"),
                "db": str(o / "data.db"), "victim": self.victim.pid, "victim_pg": self.victim.pid, "token": token,
                "tcp_port": self.tcp.getsockname()[1], "udp_port": self.udp.getsockname()[1],
                "unix_path": self.unix_path, "abstract": self.abstract_name}

    @staticmethod
    def _trainer() -> tuple:
        me = os.getpid()
        return (os.getpriority(os.PRIO_PROCESS, me), os.sched_getscheduler(me), sorted(os.sched_getaffinity(me)),
                resource.getrlimit(resource.RLIMIT_NOFILE), Path("/proc/self/oom_score_adj").read_text().strip())

    def state(self) -> dict:
        """What an escape could change, as seen from the trainer."""
        files = {}
        for p in sorted(self.outside.rglob("*")):
            st = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else None
            files[str(p.relative_to(self.outside))] = (st.st_mode, st.st_size, st.st_mtime_ns, digest,
                                                       sorted(os.listxattr(p, follow_symlinks=False)))
        victim = self.victim.pid
        alive = self.victim.poll() is None
        return {"outside files": files, "trainer": self._trainer(),
                "victim": (os.getpriority(os.PRIO_PROCESS, victim), os.sched_getscheduler(victim)) if alive else "dead"}

    def _arrivals(self) -> list[str]:
        got = []
        for name, s in (("tcp", self.tcp), ("unix", self.unix), ("abstract", self.abstract)):
            try:
                conn, _ = s.accept()
                conn.close()
                got.append(f"a {name} connection arrived")
            except BlockingIOError:
                pass
        try:
            self.udp.recv(100)
            got.append("a UDP datagram arrived")
        except BlockingIOError:
            pass
        return got

    def judge(self, attempt: Attempt, run: Callable[[str, Limits], SandboxResult]) -> tuple[list[str], SandboxResult]:
        """Run ``attempt`` through ``run(code, limits)``; return what escaped (empty: contained)."""
        token = "rlcli-hostile-" + secrets.token_hex(6)
        before, n_signals = self.state(), len(self.signals)
        r = run(Template(attempt.code).substitute(self.values(token)), attempt.limits or FAST)
        problems = []
        if r.status == "sandbox_error":
            problems.append(f"the sandbox did not run: {r.stderr.strip()[-300:]}")
        if "ESCAPED" in r.stdout:
            problems.append("the operation went through (ESCAPED printed)")
        if self.secret_text in r.stdout or self.secret_text in r.stderr:
            problems.append("the secret was read")
        after = self.state()
        problems += _changes(before, after)
        if len(self.signals) != n_signals:
            problems.append("the trainer received a signal")
        dirs = ("/tmp", "/dev/shm", tempfile.gettempdir())  # the last: where the sandbox's folder was made
        leftovers = sorted({p for d in dirs for p in glob.glob(f"{d}/{token}*")})
        if leftovers:
            problems.append(f"files were created: {leftovers}")
        problems += self._arrivals()
        last = (r.stderr.strip().splitlines() or [""])[-1]
        if last.startswith(_BROKEN):
            problems.append(f"the attempt broke before it tried anything: {last}")
        if attempt.expect is not None and (why := attempt.expect(r)):
            problems.append(why)
        if problems:
            self.repair(leftovers)
        return problems, r

    def repair(self, leftovers: list[str]) -> None:
        """After an escape: put back what later attempts need, so that their verdicts stay their own."""
        for p in leftovers:
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
        shutil.rmtree(self.outside)
        self._populate()
        if self.victim.poll() is not None:
            self.victim = self._start_victim()
        nice, policy, cpus, nofile, oom = self.trainer_before
        me = os.getpid()
        for undo in (lambda: os.setpriority(os.PRIO_PROCESS, me, nice),
                     lambda: os.sched_setscheduler(me, policy, os.sched_param(0)),
                     lambda: os.sched_setaffinity(me, cpus), lambda: resource.setrlimit(resource.RLIMIT_NOFILE, nofile),
                     lambda: Path("/proc/self/oom_score_adj").write_text(oom)):
            try:
                undo()
            except OSError:  # not allowed to this user: the next verdict may show it again
                pass
