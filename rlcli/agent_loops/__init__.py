"""Agent loops: how one prompt becomes a judged response.

An agent loop is built per task with the run's backend, judge pool and tokenizer. The runner
calls ``await run_group(samples)``; the loop generates every sample concurrently, appends the
new tokens (with logprobs and per-token policy versions) to what the sample already holds
- which is how partial rollouts are continued after a pause - sets the status from the finish
reason, and judges COMPLETED samples. Nothing here re-tokenizes text: training uses the token
ids exactly as generated. The contract is :class:`~rlcli.agent_loops.base.AgentLoop`'s
docstring; the built-ins are ``single_turn`` (:mod:`rlcli.agent_loops.single_turn`) and
``multi_turn`` (:mod:`rlcli.agent_loops.multi_turn`).
"""

from __future__ import annotations

from rlcli import hookimpl
from rlcli.agent_loops.base import AgentLoop, AgentLoopConfig, request_seed, run_group_isolated
from rlcli.agent_loops.single_turn import SingleTurnAgentLoop

__all__ = ["AgentLoop", "AgentLoopConfig", "SingleTurnAgentLoop", "register_agent_loops", "request_seed",
           "run_group_isolated"]


@hookimpl
def register_agent_loops():
    from rlcli.agent_loops.multi_turn import MultiTurnAgentLoop

    return [SingleTurnAgentLoop, MultiTurnAgentLoop]
