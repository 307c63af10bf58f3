"""Fault injection for crash tests: ``RLCLI_FAULT=<point>`` SIGKILLs the process at that point.

Used by the test suite to prove that a process killed at the worst moment (e.g. in the middle
of writing a checkpoint) loses nothing that was already saved. Points are named
``<where>:<detail>``, e.g. ``checkpoint:after_weights:step-6``.
"""

from __future__ import annotations

import os
import signal


def fault_point(name: str) -> None:
    if os.environ.get("RLCLI_FAULT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
