"""Hostile code is contained: the attempts of ``hostile.py``, each judged from outside.

The audit hook runs inside the sandboxed interpreter and any C library goes around it, so each
attempt runs with the hook left out (``audit_hook=False``): the kernel layers must contain it on
their own. The shipped sandbox only adds the hook on top - the child's setup is otherwise the
same and the hook can only refuse more - so what holds here holds as shipped. Where this machine
lacks the kernel layer an attempt needs, the attempt runs as shipped if the hook stops it too,
and skips naming the missing layer if not.

Samples run again with one layer taken away, to show that the next one holds alone: without
namespaces (``network: audit``, as in a container that forbids them: Landlock and seccomp, no
read-only mounts), without seccomp (Landlock's signal and socket scoping), without Landlock (the
read-only mounts and seccomp).
"""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from hostile import ATTEMPTS, Harness, skip_reason  # noqa: E402

from rlcli_python_tool import kernel_layers, run_python  # noqa: E402

SIGNALS = ["kill_parent", "kill_victim", "killpg_victim", "kill_everyone", "pidfd_parent", "pidfd_proc_dir",
           "sigio_parent", "ctypes_kill_victim"]
WRITES = ["write_open", "write_tmp", "write_truncate", "write_rename_in", "write_sqlite_attach",
          "write_sqlite_vacuum_into", "write_dbm", "write_proc_parent_oom"]
# id suffix -> (network, layers left out, attempts)
VARIANTS = {
    "without-namespaces": ("audit", (), WRITES + ["write_chmod", "write_utime", "write_setxattr", "udp_send",
                                                   "tcp_connect", "abstract_connect"]),
    "without-seccomp": ("auto", ("seccomp",), SIGNALS + ["ctypes_ptrace_seize_parent", "abstract_connect",
                                                        "tcp_connect"]),
    "without-landlock": ("auto", ("landlock",), WRITES + ["kill_parent", "pidfd_parent", "sigio_parent"]),
}
CASES = [pytest.param(a, "auto", (), id=a.name) for a in ATTEMPTS] + [
    pytest.param(a, network, without, id=f"{a.name}-{suffix}")
    for suffix, (network, without, names) in VARIANTS.items() for a in ATTEMPTS if a.name in names]


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    h = Harness(tmp_path_factory.mktemp("hostile"))
    yield h
    h.close()


def test_the_suite_is_large_and_every_attempt_is_named_once():
    names = [a.name for a in ATTEMPTS]
    assert len(names) >= 50 and len(set(names)) == len(names)
    assert all(set(v[2]) <= set(names) for v in VARIANTS.values())


@pytest.mark.parametrize("attempt, network, without", CASES)
def test_hostile_code_is_contained(harness, attempt, network, without):
    layers = dict(kernel_layers(network=network).layers, **{name: 0 for name in without})
    audit_hook = skip_reason(attempt, layers, audit_hook=False) is not None  # the kernel alone cannot judge it
    reason = skip_reason(attempt, layers, audit_hook)
    if reason:
        pytest.skip(reason)

    def run(code, limits):
        return asyncio.run(run_python(code, limits, network=network, audit_hook=audit_hook, without=without))

    problems, r = harness.judge(attempt, run)
    assert r.layers, f"the bootstrap reported no kernel layers: {r.stderr[-500:]}"
    assert all(not r.layers[name] for name in without)
    assert not problems, (f"{attempt.name} (network {network}, without {without}, audit hook {audit_hook}) escaped: "
                          f"{problems}\nstatus {r.status}\nstdout {r.stdout[-500:]!r}\nstderr {r.stderr[-800:]}")
