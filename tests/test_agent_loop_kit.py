"""rlcli.testing.agent_loop_conformance: it passes on the built-in loops and on a correct two-turn loop,
and each check fails on a loop that breaks the rule it checks. Also: a loop that raises fails only
the sample it was running."""

from __future__ import annotations

import asyncio
import logging
from typing import ClassVar

import pytest

from rlcli.agent_loops import AgentLoop, SingleTurnAgentLoop, request_seed
from rlcli.agent_loops.multi_turn import MultiTurnAgentLoop
from rlcli.backends.base import GenerateRequest
from rlcli.testing import agent_loop_conformance as alc
from rlcli.types import Sample, Status, status_from_finish_reason


def single_turn(sample_params, **runtime):
    return SingleTurnAgentLoop(SingleTurnAgentLoop.Config(sample_params=sample_params), **runtime)


def multi_turn(sample_params, **runtime):
    """The tool-use toy's loop: a turn that ends with a newline runs the calculator on its line."""
    cfg = MultiTurnAgentLoop.Config.model_validate({
        "sample_params": sample_params.model_dump(), "max_turns": 3, "tools": [{"name": "calculator"}],
        "tool_format": {"name": "line", "error_template": "?\n"}})
    return MultiTurnAgentLoop(cfg, **runtime)


CALC = dict(tokenizer="builtin:calc", prompts=["12*3=", "7+8?", "(4-1)*2=", "9/3="], stop_prob=0.05)


def test_kit_passes_on_single_turn():
    assert alc.run_all(single_turn) == list(alc.ALL_CHECKS)
    assert alc.run_all(single_turn, temperature=0.0, max_tokens=5) == list(alc.ALL_CHECKS)


def test_kit_passes_on_multi_turn_and_its_episodes_insert_tool_tokens():
    assert alc.run_all(multi_turn, **CALC) == list(alc.ALL_CHECKS)
    kit = alc.make_kit(**CALC)
    samples = [kit.sample(i) for i in range(4)]
    alc.run_samples(kit.loop(multi_turn, kit.backend(), alc.RecordingJudgePool()), samples)
    assert any(0 in s.response_mask for s in samples)  # the checks saw tool output, not only model turns


# --------------------------------------------------------------------- a two-turn loop, and broken ones
class TwoTurn(AgentLoop):
    """The model answers, a separator is inserted, the model answers again; ``bug`` breaks one rule."""

    name: ClassVar[str] = "two_turn"
    bug: ClassVar[str | None] = None
    separator: ClassVar[str] = "="

    async def run_sample(self, sample: Sample) -> Sample:
        if sample.status == Status.COMPLETED:
            return sample
        p = self.config.sample_params
        if self.bug != "temperature":
            sample.temperature = p.temperature if p.temperature > 0 else 1.0
        sep = self.tokenizer.encode(self.separator, add_special_tokens=False)
        reason = None
        while reason is None:
            ids, mask = sample.response_ids, sample.response_mask
            start = max((i + 1 for i, m in enumerate(mask) if not m), default=0)
            left = p.max_tokens - len(ids)
            if len(ids) > start and ids[-1] in self.eos and 0 not in mask:  # first turn done: the separator
                add = sep[:left] if self.bug != "budget" else sep
                ids += add
                sample.logprobs += [0.0] * len(add)
                sample.token_versions += [sample.token_versions[-1]] * len(add)
                mask += [1 if self.bug == "mask" else 0] * len(add)
                reason = None if len(add) == len(sep) else "length"
                continue
            if len(ids) > start and ids[-1] in self.eos or left <= 0:
                reason = "stop" if ids[-1] in self.eos else "length"
                continue
            seed = None if self.bug == "seed" else request_seed(self.seed, sample, self.salt, start)
            ask = p.max_tokens if self.bug == "budget" else left
            out = await self.backend.generate(GenerateRequest(sample.prompt_ids + ids, p.model_copy(
                update={"max_tokens": ask}), request_id=sample.uid, seed=seed))
            ids += out.token_ids
            sample.logprobs += out.logprobs[::-1] if self.bug == "logprobs" else out.logprobs
            sample.token_versions += out.versions
            mask += [1] * len(out.token_ids)
            reason = None if out.finish_reason == "stop" else out.finish_reason
        sample.finish_reason, sample.status = reason, status_from_finish_reason(reason)
        if sample.status == Status.ABORTED:
            return sample
        if self.bug != "response":
            sample.response = await self.decoder.decode(sample.response_ids[start:])
        if sample.status == Status.COMPLETED:
            await self.judge_pool.judge(sample)
        return sample


def two_turn(bug=None):
    cls = type(f"TwoTurn_{bug}", (TwoTurn,), {"bug": bug})
    return lambda sample_params, **runtime: cls(cls.Config(sample_params=sample_params), **runtime)


def test_kit_passes_on_a_correct_two_turn_loop():
    assert alc.run_all(two_turn()) == list(alc.ALL_CHECKS)


@pytest.mark.parametrize("bug, check, message", [
    ("response", "response_set", "sample.response is empty in every COMPLETED sample"),
    ("logprobs", "tokens_aligned", "model token 1: logprob"),
    ("temperature", "tokens_aligned", "sample.temperature is 1.0 but the loop sampled at 0.7"),
    ("mask", "inserted_tokens_masked", "the tokens with response_mask 1 are not the backend's tokens"),
    ("budget", "budget_respected", r"max_tokens=\d+, EOS chance"),
    ("seed", "pause_and_continue", "response_ids differs from the run never paused"),
])
def test_each_check_fails_on_the_loop_that_breaks_its_rule(bug, check, message):
    with pytest.raises(AssertionError, match=message):
        alc.ALL_CHECKS[check](two_turn(bug))


@pytest.mark.parametrize("separator, warned", [("=", False), (" Final:", True)])
def test_inserted_text_the_tokenizer_cannot_encode_is_warned_once(caplog, separator, warned):
    """builtin:arith has no upper case: ' Final:' inserts an <unk> token in every sample."""
    cls = type("Sep", (TwoTurn,), {"separator": separator})
    kit = alc.make_kit(stop_prob=0.5)
    loop = kit.loop(lambda sp, **rt: cls(cls.Config(sample_params=sp), **rt), kit.backend(), alc.RecordingJudgePool())
    samples = [kit.sample(0, uid=u) for u in range(8)]
    with caplog.at_level(logging.WARNING, logger="rlcli.agent_loops.base"):
        asyncio.run(loop.run_group(samples))
    assert any(0 in s.response_mask for s in samples)
    hits = [r.getMessage() for r in caplog.records if "cannot encode" in r.getMessage()]
    expected = ("agent loop 'two_turn' inserted text that the tokenizer cannot encode (<unk> tokens in task "
                f"{samples[0].task_name!r}'s responses): use only characters of its vocabulary "
                "(docs/recipes.md lists the built-in tokenizers')")
    assert hits == ([expected] if warned else [])


def test_an_exception_in_the_loop_reaches_the_kit_with_its_traceback():
    class Raises(SingleTurnAgentLoop):
        async def run_sample(self, sample):
            raise KeyError("inside the loop")

    with pytest.raises(KeyError, match="inside the loop"):
        alc.check_response_set(lambda sample_params, **rt: Raises(Raises.Config(sample_params=sample_params), **rt))


# --------------------------------------------------------------------------------- failure isolation
class OneInTen(SingleTurnAgentLoop):
    async def run_sample(self, sample):
        if sample.uid % 10 == 3:
            raise ValueError(f"bad sample {sample.uid}")
        return await super().run_sample(sample)


@pytest.mark.parametrize("debug", [False, True])
def test_a_raising_loop_fails_only_its_samples(caplog, monkeypatch, debug):
    monkeypatch.setenv("RLCLI_DEBUG", "1" if debug else "0")
    kit = alc.make_kit()
    pool = alc.RecordingJudgePool()
    loop = kit.loop(lambda sp, **rt: OneInTen(OneInTen.Config(sample_params=sp), **rt), kit.backend(), pool)
    samples = [kit.sample(0, uid=u) for u in range(20)]
    with caplog.at_level(logging.INFO, logger="rlcli.agent_loops.base"):
        asyncio.run(loop.run_group(samples))
    failed = [s.uid for s in samples if s.status == Status.FAILED]
    assert failed == [3, 13] and all(s.status == Status.COMPLETED for s in samples if s.uid not in failed)
    assert samples[3].error == "agent loop 'single_turn' raised ValueError: bad sample 3"
    assert loop.pop_stats() == {"agent_loop/errors": 2.0} and loop.pop_stats() == {"agent_loop/errors": 0.0}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    with_tb = [r for r in caplog.records if r.exc_info]
    assert len(with_tb) == 2 and "bad sample 13" in str(with_tb[1].exc_info[1])
    assert len(warnings) == (2 if debug else 1)  # on the console: once, or every traceback with --debug
    assert all(r.levelno == (logging.WARNING if debug else logging.INFO) for r in with_tb)  # INFO: run.log only
