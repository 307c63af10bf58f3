"""The agent-loop contract: how one prompt's samples become generated, judged responses.

:class:`AgentLoop` states it; :func:`request_seed` gives the sampling seeds it asks for, and
:func:`run_group_isolated` is how the runner calls a loop, so that a loop that raises fails
only the samples it was running. The checks a loop's own tests run are in
:mod:`rlcli.testing.agent_loop_conformance`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any, ClassVar

from pydantic import Field

from rlcli import debug_enabled
from rlcli.backends.base import InferenceBackend
from rlcli.component import Component, ComponentConfig
from rlcli.stall import progressed
from rlcli.tokenizer import DecodeBatcher
from rlcli.types import Sample, SampleParams, Status

log = logging.getLogger(__name__)

ERRORS_METRIC = "agent_loop/errors"
"""Samples FAILED because their agent loop raised (per step; ``eval/agent_loop/errors`` in evaluation)."""

_MAX_ERROR_CHARS = 2000
_CANCEL_GRACE_S = 5.0  # a timed-out group gets this long to unwind after its cancellation


def request_seed(run_seed: int, sample: Sample, salt: str = "", start: int = 0) -> int:
    """The sampling seed of the generation that starts at response offset ``start`` (0: the
    response's first token).

    A function of saved fields only (run seed, salt, task, uid, ``tries``, ``start``), so every
    request of one generation - its first and any continuation after a pause - gets the same
    seed, and a backend that draws per (seed, position) continues exactly where it stopped.
    """
    key = f"{run_seed}:{salt}:{sample.task_name}:{sample.uid}:{sample.tries}:{start}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") & ((1 << 62) - 1)


class AgentLoopConfig(ComponentConfig):
    sample_params: SampleParams = Field(default_factory=SampleParams, description="How responses are sampled.")
    timeout_s: float | None = Field(
        None, gt=0, description="Seconds one group may take in the agent loop (generation, tool calls and "
        "judging, queueing for the engine included); past them the group is cancelled and its unfinished "
        "samples FAILED ('timed out'), so an await that never returns cannot stall the run. null: no limit.")


class AgentLoop(Component):
    """Base class of agent loops: turn one prompt's samples into generated, judged responses.

    **Built** once per task by the runner as ``cls(config, backend=..., judge_pool=...,
    tokenizer=..., eos_token_ids=..., seed=..., salt=...)``, which this class keeps as:

    * ``config``: the loop's ``Config`` (a subclass of :class:`AgentLoopConfig`);
      ``config.sample_params`` (:class:`~rlcli.types.SampleParams`) says how to sample, and its
      ``max_tokens`` is the budget of the *whole* response, tokens the loop inserts included;
    * ``backend``: the :class:`~rlcli.backends.base.InferenceBackend`:
      ``await backend.generate(GenerateRequest(...))``, ``backend.version`` (the policy version it
      serves);
    * ``judge_pool``: ``await judge_pool.judge(sample)`` scores a COMPLETED sample in place (sets
      ``reward``, or makes the sample FAILED with ``error``; it never raises for a judger error);
    * ``tokenizer`` (a Hugging Face tokenizer), ``decoder`` (``await decoder.decode(ids)``: ids
      to text, batched with the other samples), ``eos`` (the set of EOS ids);
    * ``seed`` (the run's seed) and ``salt`` (``"train:<task>"`` or ``"eval:<task>"``), the
      inputs of :func:`request_seed`.

    The runner calls ``await run_group(samples)`` with a group's samples; the default runs
    :meth:`run_sample` on each, concurrently. ``run_sample(sample)`` must:

    1. return a COMPLETED sample as it is (a member kept from an earlier round);
    2. generate with ``GenerateRequest(prompt_ids=sample.prompt_ids + sample.response_ids,
       params=..., request_id=sample.uid, seed=...)``: ``prompt_ids`` is exactly the context the
       trainer will see before the new tokens, ``params`` asks for no more than what is left of
       ``max_tokens``, and ``seed`` comes from saved fields only (:func:`request_seed` with the
       offset where the generation started);
    3. append what the backend returned, never re-tokenized text: ``response_ids +=
       out.token_ids``, ``logprobs += out.logprobs``, ``token_versions += out.versions``,
       ``response_mask += [1] * len(out.token_ids)``; tokens the loop inserts itself (a tool's
       output, a follow-up question) get ``response_mask`` 0, logprob 0.0 and the version of the
       model token before them (``backend.version`` when there is none). The four lists always
       have the same length (``logprobs`` excepted when ``sample_params.return_logprob`` is false:
       the backend returns none, and inserted tokens add none); mask-0 tokens are never trained on;
    4. set ``sample.temperature`` to the sampling temperature (1.0 for greedy): the trainer
       recomputes the logprobs at it;
    5. set ``finish_reason`` and ``status = status_from_finish_reason(finish_reason)``:
       ``"stop"``, ``"length"`` and ``"tool_calls"`` make it COMPLETED, ``"abort"`` ABORTED,
       anything else (``"error"``, ``"aborted"``, None) FAILED - say why in ``sample.error``;
    6. set ``sample.response``, the text the judger reads (the decoded response, or the part of
       it to judge): a loop that leaves it empty has every sample judged on ``""``;
    7. ``await self.judge_pool.judge(sample)`` if the sample is COMPLETED.

    **Pause and continue.** A pause makes ``generate`` return at once with the tokens so far and
    ``finish_reason "abort"``; the loop appends them, sets ABORTED and returns without judging.
    A judge call cut by a pause also leaves the sample ABORTED (``reward`` None). The sample is
    later passed to ``run_sample`` again with everything it holds (``resumes`` counts this), and
    the loop must decide what to do from the sample's fields alone (its tokens, mask and
    ``extra_info``), never from state kept in the loop: with the same weights, a paused and
    continued sample ends with the same tokens as one never paused. A sample restarted from
    scratch comes back with an empty response and ``tries`` one higher.

    **One sample, one coroutine.** The samples of a group run concurrently on one event loop:
    keep per-sample state on the sample (``extra_info`` is shared by a group's samples, so copy
    it before writing), never in ``self``.

    **Failures.** An exception raised by ``run_sample`` fails only that sample: it becomes FAILED
    with ``error`` "agent loop ... raised ...", its traceback goes to ``run.log``, it is counted
    in ``agent_loop/errors``, and the rest of the group still trains. :func:`run_group_isolated`
    does the same for a ``run_group`` override that raises (for every sample not yet judged), and
    for a sample returned malformed (:func:`sample_problem`: lists of different lengths, ids that
    are not integers >= 0, more than ``max_tokens`` response tokens, a changed prompt).

    :mod:`rlcli.testing.agent_loop_conformance` checks all of this against a scripted backend.
    """

    Config: ClassVar[type[AgentLoopConfig]] = AgentLoopConfig

    def __init__(self, config: AgentLoopConfig, *, backend: InferenceBackend, judge_pool: Any, tokenizer: Any,
                 eos_token_ids: list[int], seed: int, salt: str = ""):
        super().__init__(config)
        self.backend, self.judge_pool, self.tokenizer = backend, judge_pool, tokenizer
        self.decoder = DecodeBatcher(tokenizer)  # the responses one engine step finished: one batch decode
        self.eos = set(eos_token_ids)
        self.seed, self.salt = seed, salt
        self._errors = 0
        self._warned = self._unk_warned = False

    async def run_group(self, samples: list[Sample]) -> list[Sample]:
        """Run every sample concurrently; a sample whose :meth:`run_sample` raises is FAILED alone."""
        await asyncio.gather(*(self._run_isolated(s) for s in samples))
        return samples

    async def run_sample(self, sample: Sample) -> Sample:
        """Generate, append, set the status and the response, judge (see the class docstring)."""
        raise NotImplementedError

    async def _run_isolated(self, sample: Sample) -> None:
        try:
            await self.run_sample(sample)
        except Exception as exc:  # a bug in the loop fails its sample, not the run
            self.fail_sample(sample, exc)
            return
        if not getattr(self, "_unk_warned", False):
            self._warn_inserted_unknown(sample)

    def _warn_inserted_unknown(self, sample: Sample) -> None:
        """Warn once when text the loop inserted (mask 0) encoded to the tokenizer's unknown token."""
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if unk is None or all(sample.response_mask):  # a C-level pass: all generated, nothing inserted
            return
        if any(i == unk and not m for i, m in zip(sample.response_ids, sample.response_mask)):
            self._unk_warned = True
            log.warning("agent loop %r inserted text that the tokenizer cannot encode (%s tokens in task %r's "
                        "responses): use only characters of its vocabulary (docs/recipes.md lists the built-in "
                        "tokenizers')", getattr(self, "name", type(self).__name__), self.tokenizer.unk_token,
                        sample.task_name)

    def fail_sample(self, sample: Sample, exc: BaseException) -> None:
        """Make ``sample`` FAILED because the loop raised ``exc`` while running it.

        The traceback goes to ``run.log`` (and, the first time or with ``RLCLI_DEBUG``, a line to
        the console); the sample is counted in ``agent_loop/errors``.
        """
        name = getattr(self, "name", type(self).__name__)
        reason = f"agent loop {name!r} raised {type(exc).__name__}: {exc}"
        if len(reason) > _MAX_ERROR_CHARS:
            reason = reason[: _MAX_ERROR_CHARS - 3] + "..."
        sample.status, sample.reward, sample.error, sample.finish_reason = Status.FAILED, None, reason, "error"
        self._errors += 1
        where = f"sample uid={sample.uid} of task {sample.task_name!r}"
        if debug_enabled():
            log.warning("%s on %s; the sample is FAILED", reason, where, exc_info=exc)
            return
        if not self._warned:
            self._warned = True
            log.warning("%s on %s; the sample is FAILED and the run goes on (counted in %s; every traceback is "
                        "in run.log, or on the console with rlcli --debug)", reason, where, ERRORS_METRIC)
        log.info("%s on %s; the sample is FAILED", reason, where, exc_info=exc)

    def pop_stats(self) -> dict[str, float]:
        """``agent_loop/errors`` since the last call, then reset it."""
        n, self._errors = self._errors, 0
        return {ERRORS_METRIC: float(n)}


class MalformedSample(ValueError):
    """A sample an agent loop returned that cannot be trained on (what is wrong, in the message)."""


def sample_problem(sample: Sample, prompt_ids: list[int], max_tokens: int | None) -> str | None:
    """What makes a sample the loop returned untrainable, or None: lists of different lengths, token
    ids that are no ids, a response over the budget, a prompt the loop changed."""
    n = len(sample.response_ids)
    for name in ("response_mask", "token_versions", "logprobs"):
        k = len(getattr(sample, name))
        if k != n and not (name == "logprobs" and k == 0):
            return f"the sample it returned has {k} {name} for {n} response_ids"
    bad = next((t for t in sample.response_ids if type(t) is not int or t < 0), None)
    if bad is not None:
        return f"the sample it returned holds {bad!r} among its response_ids (token ids are integers >= 0)"
    if max_tokens is not None and n > max_tokens:
        return f"the sample it returned has {n} response tokens, over sample_params.max_tokens={max_tokens}"
    if sample.prompt_ids != prompt_ids:
        return "it changed the sample's prompt_ids (the prompt is the data's; responses go in response_ids)"
    return None


def _fail(loop: Any, s: Sample, exc: BaseException) -> None:
    if isinstance(loop, AgentLoop):
        loop.fail_sample(s, exc)
    else:
        log.warning("agent loop %r raised on sample uid=%s", type(loop).__name__, s.uid, exc_info=exc)
        s.status, s.reward, s.error = Status.FAILED, None, f"agent loop raised {type(exc).__name__}: {exc}"


class AgentLoopTimeout(TimeoutError):
    """A group took longer than its agent loop's ``timeout_s``."""


async def _run_limited(loop: Any, samples: list[Sample], timeout: float | None) -> None:
    """``await loop.run_group(samples)``, cancelled after ``timeout`` seconds (:class:`AgentLoopTimeout`)."""
    if timeout is None:
        await loop.run_group(samples)
        return
    task = asyncio.ensure_future(loop.run_group(samples))
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if done:
        task.result()
        return
    task.cancel()
    await asyncio.wait({task}, timeout=_CANCEL_GRACE_S)  # let it unwind; one that ignores cancellation is left
    if not task.done():
        log.warning("agent loop %r kept running %.0f s after its group was cancelled (timeout_s)",
                    type(loop).__name__, _CANCEL_GRACE_S)
    elif not task.cancelled():
        task.exception()  # retrieved: asyncio does not log it as "never retrieved"
    raise AgentLoopTimeout(f"the group took longer than agent_loop.timeout_s={timeout:g} s; it was cancelled")


async def run_group_isolated(loop: Any, samples: list[Sample]) -> list[Sample]:
    """``await loop.run_group(samples)``, where an exception fails the samples not yet judged
    (FAILED, counted and logged by :meth:`AgentLoop.fail_sample`) instead of ending the run, and
    so does a sample returned malformed (:func:`sample_problem`) and a group past the loop's
    ``timeout_s``. Cancellation is passed on."""
    prompts = [list(s.prompt_ids) for s in samples]
    timeout = getattr(getattr(loop, "config", None), "timeout_s", None)
    try:
        await _run_limited(loop, samples, timeout)
    except Exception as exc:  # a run_group override that raised, or the group timed out
        for s in samples:
            if s.status != Status.COMPLETED or s.reward is None:
                _fail(loop, s, exc)
    finally:
        progressed()
    params = getattr(getattr(loop, "config", None), "sample_params", None)
    max_tokens = getattr(params, "max_tokens", None)
    for s, prompt in zip(samples, prompts):
        problem = None if s.status == Status.FAILED else sample_problem(s, prompt, max_tokens)
        if problem is not None:
            _fail(loop, s, MalformedSample(problem))
    return samples
