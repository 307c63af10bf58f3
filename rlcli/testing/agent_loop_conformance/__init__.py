"""Checks for agent loops (the contract of :class:`rlcli.agent_loops.base.AgentLoop`), for a
plugin's own tests.

Every check builds the loop under test with a factory, runs it against a
:class:`ScriptedBackend` (a stand-in model that samples per seed and position, like the
embedded engine, with no model) and a :class:`RecordingJudgePool`, and raises
``AssertionError`` saying what broke the contract::

    from rlcli.testing import agent_loop_conformance as alc

    def make_loop(sample_params, **runtime):
        return MyLoop(MyLoop.Config(sample_params=sample_params), **runtime)

    def test_my_loop_keeps_the_agent_loop_contract():
        alc.run_all(make_loop)

The checks (:data:`ALL_CHECKS`):

* ``response_set``: a status that follows the finish reason; a COMPLETED sample is judged once,
  with ``sample.response`` set;
* ``tokens_aligned``: one logprob, mask and version per token, the backend's own for model tokens;
  each request's context is the prompt and the response before it; ``sample.temperature`` set;
* ``inserted_tokens_masked``: mask 1 on exactly the backend's tokens, 0 on what the loop inserts;
* ``budget_respected``: ``sample_params.max_tokens`` bounds the whole response;
* ``pause_and_continue``: a request cut by a pause, or a judge call cut by one, then continued,
  ends exactly as a run never paused.

Options every check takes (and :func:`run_all` passes on): ``tokenizer`` (default
``builtin:arith``), ``prompts``, ``vocab`` (the token ids the scripted model draws; default: every
non-special token - give the tokens that make your loop take its other paths, e.g. a format's
stop token), ``max_tokens`` (default 24), ``temperature`` (default 1.0) and ``stop_prob`` (the
chance of EOS at each token, default 0.15). An exception the loop raises propagates with its
traceback (in a run it would fail that sample: ``agent_loop/errors``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from rlcli.testing.agent_loop_conformance.checks import (
    DEFAULT_PROMPTS,
    Kit,
    LoopFactory,
    check_budget_respected,
    check_inserted_tokens_masked,
    check_pause_and_continue,
    check_response_set,
    check_tokens_aligned,
    make_kit,
    run_samples,
)
from rlcli.testing.agent_loop_conformance.fakes import RecordingJudgePool, ScriptedBackend, Served, token_vocab
from rlcli.testing.checks import run_checks

ALL_CHECKS: dict[str, Callable[..., None]] = {
    "response_set": check_response_set,
    "tokens_aligned": check_tokens_aligned,
    "inserted_tokens_masked": check_inserted_tokens_masked,
    "budget_respected": check_budget_respected,
    "pause_and_continue": check_pause_and_continue,
}
"""Every check by short name (what ``run_all``'s ``skip`` refers to)."""


def run_all(make_loop: LoopFactory, *, skip: Iterable[str] = (), **options: Any) -> list[str]:
    """Run every check but those named in ``skip``, each with ``options``; returns the names run.
    The first failure raises ``AssertionError`` prefixed with the check's name."""
    return run_checks(ALL_CHECKS, lambda name, check: check(make_loop, **options), skip)


__all__ = [
    "ALL_CHECKS", "DEFAULT_PROMPTS", "Kit", "LoopFactory", "RecordingJudgePool", "ScriptedBackend", "Served",
    "check_budget_respected", "check_inserted_tokens_masked", "check_pause_and_continue", "check_response_set",
    "check_tokens_aligned", "make_kit", "run_all", "run_samples", "token_vocab",
]
