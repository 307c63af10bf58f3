"""Kept for compatibility: the judge pool lives in :mod:`rlcli.judgers.pool`.

Plugins, their tests and the docs import ``JudgePool`` from ``rlcli.judging``; every name
imported from here before the pool moved is re-exported. New code imports from
:mod:`rlcli.judgers.pool` (the pool), :mod:`rlcli.judgers.calls` (``normalize_reward``),
:mod:`rlcli.judgers.threads` and :mod:`rlcli.judgers.processes` (the executors).

Patching a name here (``mock.patch("rlcli.judging.xyz")``) does not reach the pool: patch it
in the module that uses it.
"""

from __future__ import annotations

from rlcli.judgers.calls import normalize_reward
from rlcli.judgers.pool import Executor, JudgePool, default_workers  # noqa: F401 - Executor too
from rlcli.judgers.processes import _exit_reason, _exitcode, _Proc  # noqa: F401 - imported from here before

__all__ = ["JudgePool", "default_workers", "normalize_reward"]
