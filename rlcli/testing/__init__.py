"""Test utilities for rlcli and its plugins.

:mod:`rlcli.testing.backend_conformance` checks that an inference backend honours the
contract of :mod:`rlcli.backends.base` (greedy parity with transformers, logprobs, stop
handling, pause/continue, weight updates, sleep/wake, concurrency).
"""

from rlcli.testing import backend_conformance

__all__ = ["backend_conformance"]
