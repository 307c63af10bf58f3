"""The files ``rlcli new agent-loop NAME`` fills in: a multi-turn agent loop without tools, its tests
(with the agent-loop kit), its recipe."""

from __future__ import annotations

from rlcli.scaffold.templates import KindTemplate

MODULE = '''\
"""rlcli plugin: the ``{{name}}`` agent loop.

Written by ``rlcli new agent-loop {{name}}`` as a starting point: a multi-turn loop without tools.
The model answers; the loop inserts a reply (``{{Class}}.reply``: by default the ``follow_up``
text) and the model answers again, up to ``turns`` answers; the judger reads the last answer.
Make it an environment, a user simulator or a hint giver by changing ``reply``.

The contract every agent loop keeps (the docstring of ``rlcli.agent_loops.base.AgentLoop``;
rlcli's docs/plugins.md), and how this loop keeps it:

* each request's prompt is ``sample.prompt_ids + sample.response_ids``; the backend's
  ``token_ids``, ``logprobs`` and ``versions`` are appended as they are, with ``response_mask`` 1;
  inserted tokens get mask 0, logprob 0.0 and the version of the token before them;
* ``sample_params.max_tokens`` bounds the whole response, inserted tokens included;
* ``finish_reason`` sets the status (``status_from_finish_reason``); ``sample.response`` (what the
  judger reads) is set, and only a COMPLETED sample is judged;
* a pause makes ``generate`` return early with ``"abort"``: the sample is returned ABORTED and
  ``run_sample`` is called again later; every step is decided from the sample's fields alone
  (never from state in ``self``), and the request seed depends only on saved fields, so a
  continued sample ends as one never paused.

``tests/test_{{name}}.py`` checks this with ``rlcli.testing.agent_loop_conformance``.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from rlcli import hookimpl
from rlcli.agent_loops.base import AgentLoop, AgentLoopConfig, request_seed
from rlcli.backends.base import GenerateRequest
from rlcli.types import Sample, Status, status_from_finish_reason

__version__ = "0.1.0"
__all__ = ["{{Class}}", "{{Cls}}Config", "answer_spans", "register_agent_loops"]


class {{Cls}}Config(AgentLoopConfig):
    """The recipe options of the loop (``sample_params`` comes from ``AgentLoopConfig``)."""

    turns: int = Field(2, ge=1, description="Answers per sample at most; the judger reads the last one.")
    follow_up: str = Field(" again? ", description="The reply inserted after each answer but the last "
                                                   "(never trained on).")
    answer_max_tokens: int | None = Field(None, gt=0, description="Tokens per answer at most: an answer ends at "
                                          "EOS or at this length. null: only at EOS (or a stop token).")


class {{Class}}(AgentLoop):
    """Answer, read a reply, answer again; the judger reads the last answer."""

    name: ClassVar[str] = "{{name}}"  # what recipes write: agent_loop: {name: {{name}}}
    Config: ClassVar[type[{{Cls}}Config]] = {{Cls}}Config
    config: {{Cls}}Config

    def reply(self, answers: list[str]) -> str | None:
        """The text to insert after the model's answers so far (oldest first), or None to end the
        episode. Decide from ``answers`` alone: a paused sample is continued from its tokens."""
        return self.config.follow_up if len(answers) < self.config.turns else None

    async def run_sample(self, sample: Sample) -> Sample:
        if sample.status == Status.COMPLETED:  # kept from an earlier round: nothing to do
            return sample
        params = self.config.sample_params
        sample.temperature = params.temperature if params.temperature > 0 else 1.0
        reason = None
        while reason is None:
            reason = await self.step(sample)
        sample.finish_reason, sample.status = reason, status_from_finish_reason(reason)
        if sample.status == Status.ABORTED:  # paused: called again later with what the sample holds
            return sample
        answers = await self.answers(sample)
        sample.response = answers[-1] if answers else ""  # what the judger reads
        if sample.status == Status.COMPLETED:
            await self.judge_pool.judge(sample)
        return sample

    async def step(self, sample: Sample) -> str | None:
        """Generate, or insert a reply: the finish reason once the episode is over, else None."""
        ids, mask = sample.response_ids, sample.response_mask
        left = self.config.sample_params.max_tokens - len(ids)
        answering = bool(ids) and mask[-1] == 1  # the last token is the model's
        ended = answering and self.answer_ended(sample)
        if left <= 0:
            return "stop" if ended else "length"
        if not ended:  # a new answer, or one cut by a pause (continued from where it started)
            start = answer_spans(mask)[-1][0] if answering else len(ids)
            reason = await self.generate(sample, start, left)
            return None if reason in ("stop", "length") and self.answer_ended(sample) else reason
        text = self.reply(await self.answers(sample))
        inserted = self.tokenizer.encode(text, add_special_tokens=False)[:left] if text else []
        if not inserted:
            return "stop"
        version = sample.token_versions[-1]  # that of the answer before
        sample.response_ids += inserted
        if sample.logprobs or self.config.sample_params.return_logprob:  # else the sample holds none
            sample.logprobs += [0.0] * len(inserted)
        sample.token_versions += [version] * len(inserted)
        sample.response_mask += [0] * len(inserted)  # inserted: never trained on
        return None

    async def generate(self, sample: Sample, start: int, left: int) -> str:
        """One request for the answer that starts at response offset ``start`` (tokens of it are
        there already when a pause cut it); the backend's finish reason."""
        params, cap = self.config.sample_params, self.config.answer_max_tokens
        done = len(sample.response_ids) - start  # tokens of this answer before a pause
        left = min(left, cap - done) if cap else left
        out = await self.backend.generate(GenerateRequest(
            prompt_ids=sample.prompt_ids + sample.response_ids,  # exactly the context the trainer sees
            params=params.model_copy(update={"max_tokens": left,
                                             "min_tokens": min(max(params.min_tokens - done, 0), left)}),
            request_id=sample.uid,
            seed=request_seed(self.seed, sample, self.salt, start),  # the same for a continuation
        ))
        sample.response_ids += out.token_ids
        sample.logprobs += out.logprobs
        sample.token_versions += out.versions
        sample.response_mask += [1] * len(out.token_ids)
        if out.error:
            sample.error = out.error
        return out.finish_reason

    def answer_ended(self, sample: Sample) -> bool:
        """Whether the response ends with a finished answer: a stop token (EOS or
        ``sample_params.stop_token_ids``), or ``answer_max_tokens`` model tokens in a row."""
        ids, mask, cap = sample.response_ids, sample.response_mask, self.config.answer_max_tokens
        if not ids or mask[-1] != 1:
            return False
        if ids[-1] in self.eos or ids[-1] in self.config.sample_params.stop_token_ids:
            return True
        first, last = answer_spans(mask)[-1]
        return cap is not None and last - first >= cap

    async def answers(self, sample: Sample) -> list[str]:
        """The text of each answer (each run of model tokens), oldest first."""
        return [await self.decoder.decode(sample.response_ids[a:b]) for a, b in answer_spans(sample.response_mask)]


def answer_spans(mask: list[int]) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of model tokens (``response_mask`` 1) in a response."""
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(mask):
        if m != 1:
            continue
        if spans and spans[-1][1] == i:
            spans[-1] = (spans[-1][0], i + 1)
        else:
            spans.append((i, i + 1))
    return spans


@hookimpl
def register_agent_loops() -> list[type]:
    return [{{Class}}]
'''

TESTS = '''\
"""Tests of the {{name}} agent loop: the agent-loop contract (rlcli's kit), one episode's layout,
its entry point. No model: a scripted backend stands in for one."""

import asyncio

import pytest

from rlcli.plugins import get_registry
from rlcli.testing import agent_loop_conformance as kit
from rlcli.types import SampleParams, Status

from {{module}} import {{Class}}


def run_one(loop_class=None):
    """One episode against the kit's scripted model (builtin:arith; it often ends an answer early)."""
    k = kit.make_kit(stop_prob=0.3)
    backend, judge_pool = k.backend(), kit.RecordingJudgePool()
    config = {{Class}}.Config(sample_params=SampleParams(max_tokens=40))
    loop = (loop_class or {{Class}})(config, backend=backend, judge_pool=judge_pool, tokenizer=k.tokenizer,
                                    eos_token_ids=[k.eos], seed=0)
    sample = k.sample(0)
    asyncio.run(loop.run_sample(sample))
    answers = [served.output.token_ids for served in backend.served]
    return k.tokenizer, sample, answers, judge_pool.judged


@pytest.mark.parametrize("answer_max_tokens", [None, 3])
def test_keeps_the_agent_loop_contract(answer_max_tokens):
    def make_loop(sample_params, **runtime):
        """What the kit builds the loop with: the sample parameters it wants, the runner's keyword arguments."""
        config = {{Class}}.Config(sample_params=sample_params, answer_max_tokens=answer_max_tokens)
        return {{Class}}(config, **runtime)

    assert kit.run_all(make_loop) == list(kit.ALL_CHECKS)


def test_answer_reply_answer():
    tok, sample, (first, second), judged = run_one()
    reply = tok.encode({{Class}}.Config().follow_up, add_special_tokens=False)
    assert sample.response_ids == first + reply + second  # the model's tokens and ours, as they are
    assert sample.response_mask == [1] * len(first) + [0] * len(reply) + [1] * len(second)
    assert sample.status == Status.COMPLETED
    assert judged == [(sample.uid, Status.COMPLETED, tok.decode(second, skip_special_tokens=True))]


def test_the_reply_decides_when_the_episode_ends():
    class OneAnswer({{Class}}):
        def reply(self, answers):
            return None

    tok, sample, answers, judged = run_one(OneAnswer)
    assert len(answers) == 1 and sample.response_ids == answers[0] and set(sample.response_mask) == {1}
    assert judged == [(sample.uid, Status.COMPLETED, tok.decode(answers[0], skip_special_tokens=True))]


def test_rlcli_finds_it_once_installed():
    """Passes once the package is installed (pip install -e .): the entry point in pyproject.toml."""
    entry = get_registry(refresh=True).entry("agent_loop", "{{name}}")
    assert entry.cls is {{Class}} and entry.dist == "{{dist}}"
'''

RECIPE_TASK = '''\
    agent_loop:
      name: {{name}}
      sample_params: {max_tokens: 3, temperature: 1.0}   # the whole response: answer, reply, answer
      turns: 2
      follow_up: "="          # "3+4=" -> "7" "=" "7": the judger reads the last answer
      answer_max_tokens: 1
    judger: {name: exact_match, executor: inline}'''

RECIPE_EVAL_TASK = '''\
      agent_loop:
        name: {{name}}
        sample_params: {max_tokens: 3, temperature: 0.0}
        follow_up: "="
        answer_max_tokens: 1
      judger: {name: exact_match, executor: inline}'''

README_YAML = '''\
    agent_loop:
      name: {{name}}
      sample_params: {max_tokens: 256, temperature: 1.0}   # the budget of the whole response
      turns: 2                # answers at most; the judger reads the last one
      follow_up: " again? "   # inserted after each answer but the last, never trained on
      answer_max_tokens: 64   # an answer ends at EOS or at this length (default: only at EOS)
    judger: {name: exact_match}'''

README_TEXT = '''\
Change `reply` in `{{module}}/__init__.py` to decide what the loop inserts after each answer (an
environment's observation, a simulated user's message, a hint) or to end the episode early. The
text is tokenized once and appended with `response_mask` 0, so the model is never trained on it.'''

TEMPLATE = KindTemplate(
    title="agent loop", registry_kind="agent_loop", hook="register_agent_loops", class_suffix="Loop",
    module=MODULE, tests=TESTS, tokenizer="builtin:digits", recipe_task=RECIPE_TASK,
    recipe_eval_task=RECIPE_EVAL_TASK, readme_yaml=README_YAML,
    readme_text=README_TEXT,
)
