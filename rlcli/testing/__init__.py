"""Test utilities for rlcli and its plugins: checks a plugin's own tests run against its component.

* :mod:`rlcli.testing.judger_conformance` checks a judger against the contract of
  :class:`rlcli.judgers.base.Judger` (scores finite and in its declared range, garbage and
  empty responses handled, deterministic, within its timeout);
* :mod:`rlcli.testing.agent_loop_conformance` checks an agent loop against the contract of
  :class:`rlcli.agent_loops.base.AgentLoop`, with a scripted backend (response set, tokens and
  their logprobs, masks and versions aligned, inserted tokens masked, budget respected, pause and
  continue exact);
* :mod:`rlcli.testing.backend_conformance` checks that an inference backend honours the
  contract of :mod:`rlcli.backends.base` (greedy parity with transformers, logprobs, stop
  handling, pause/continue, weight updates, sleep/wake, concurrency);
* :mod:`rlcli.testing.engine_plugins` helps engine plugins' tests.
"""

from rlcli.testing import agent_loop_conformance, backend_conformance, judger_conformance

__all__ = ["agent_loop_conformance", "backend_conformance", "judger_conformance"]
