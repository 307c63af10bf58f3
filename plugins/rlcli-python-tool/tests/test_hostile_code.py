"""Hostile code is contained: the attempts of ``hostile.py``, each judged from outside.

The audit hook runs inside the sandboxed interpreter and any C library goes around it, so each
attempt runs with the hook left out (``audit_hook=False``): the kernel layers must contain it on
their own. The shipped sandbox only adds the hook on top - the child's setup is otherwise the
same and the hook can only refuse more - so what holds here holds as shipped. Where this machine
lacks the kernel layer an attempt needs, the attempt runs as shipped if the hook stops it too,
and skips naming the missing layer if not. A sample of the file and network attempts runs again
without namespaces (``network: audit``), where Landlock and seccomp must hold without the
read-only mounts, as in a container that forbids user namespaces.
"""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from hostile import ATTEMPTS, Harness, skip_reason  # noqa: E402

from rlcli_python_tool import kernel_layers, run_python  # noqa: E402

WITHOUT_NAMESPACES = ["write_open", "write_tmp", "write_truncate", "write_rename_in", "write_sqlite_attach",
                      "write_sqlite_vacuum_into", "write_chmod", "write_utime", "write_setxattr",
                      "write_proc_parent_oom", "udp_send", "tcp_connect", "abstract_connect"]
CASES = [pytest.param(a, "auto", id=a.name) for a in ATTEMPTS] + [
    pytest.param(a, "audit", id=f"{a.name}-without-namespaces") for a in ATTEMPTS if a.name in WITHOUT_NAMESPACES]


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    h = Harness(tmp_path_factory.mktemp("hostile"))
    yield h
    h.close()


def test_the_suite_is_large_and_every_attempt_is_named_once():
    names = [a.name for a in ATTEMPTS]
    assert len(names) >= 50 and len(set(names)) == len(names)
    assert set(WITHOUT_NAMESPACES) <= set(names)


@pytest.mark.parametrize("attempt, network", CASES)
def test_hostile_code_is_contained(harness, attempt, network):
    layers = kernel_layers(network=network).layers
    audit_hook = skip_reason(attempt, layers, audit_hook=False) is not None  # the kernel alone cannot judge it
    reason = skip_reason(attempt, layers, audit_hook)
    if reason:
        pytest.skip(reason)

    def run(code, limits):
        return asyncio.run(run_python(code, limits, network=network, audit_hook=audit_hook))

    problems, r = harness.judge(attempt, run)
    assert r.layers, f"the bootstrap reported no kernel layers: {r.stderr[-500:]}"
    assert not problems, (f"{attempt.name} (network {network}, audit hook {audit_hook}) escaped: {problems}\n"
                          f"status {r.status}\nstdout {r.stdout[-500:]!r}\nstderr {r.stderr[-800:]}")
