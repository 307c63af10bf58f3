"""The multi_turn agent loop: token-exact episodes, masks, versions, budget, tools, partial rollout."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import ClassVar

import pytest

from rlcli.agent_loops.multi_turn import (
    STATE_KEY, HermesFormat, HermesFormatConfig, LineFormat, LineFormatConfig, MultiTurnAgentLoop, MultiTurnConfig,
    ToolCall, count_turns, episode_stats, hermes_system_prompt, rollout_metrics, turn_seed,
)
from rlcli.backends.base import GenerateOutput, GenerateRequest, InferenceBackend
from rlcli.judgers.exact_match import ExactMatchConfig, ExactMatchJudger
from rlcli.judging import JudgePool
from rlcli.tokenizer import load_tokenizer
from rlcli.tools import Calculator, Tool, ToolConfig, ToolResult
from rlcli.types import Group, Sample, SampleParams, Status


# --------------------------------------------------------------------------- test doubles
class ScriptedBackend(InferenceBackend):
    """Plays scripted model turns, like a seeded engine would.

    A turn is identified by its request seed (the loop derives one per turn); a request for a
    seed seen before continues that turn from where the previous request stopped. Logprobs
    encode (turn, position) so tests can check where each one lands; ``version`` is what the
    weights are at the time of the call. ``abort`` = {turn index: k} cuts that turn's first
    request after k tokens with finish "abort", as a pause does.
    """

    name: ClassVar[str] = "scripted"

    def __init__(self, turns: list[list[int]], eos: int, versions: list[int] | None = None):
        self.turns, self.eos = turns, eos
        self.turn_versions = versions or [0] * len(turns)
        self.seen: dict[int, tuple[int, int]] = {}
        self.requests: list[GenerateRequest] = []
        self.abort: dict[int, int] = {}

    @property
    def version(self) -> int:
        return 0

    @staticmethod
    def logprob(turn: int, pos: int) -> float:
        return -(turn + 1) - pos / 100

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self.requests.append(request)
        if request.seed not in self.seen:
            self.seen[request.seed] = (len(self.seen), len(request.prompt_ids))
        t, base = self.seen[request.seed]
        done = len(request.prompt_ids) - base
        stops = {self.eos, *request.params.stop_token_ids}
        out: list[int] = []
        for tok in self.turns[t][done:]:
            if len(out) >= request.params.max_tokens:
                break
            out.append(tok)
            if tok in stops:
                break
        reason = "stop" if out and out[-1] in stops else "length"
        if t in self.abort:
            out, reason = out[: self.abort.pop(t)], "abort"
        lps = [self.logprob(t, done + i) for i in range(len(out))] if request.params.return_logprob else []
        return GenerateOutput(out, lps, [self.turn_versions[t]] * len(out), reason)

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def update_weights(self, named_tensors, version: int) -> None: ...


class AbortingBackend(InferenceBackend):
    """Forwards to a real backend; the n-th request returns only its first k tokens, finish "abort"
    (exactly what a pause in the middle of that request returns)."""

    name: ClassVar[str] = "aborting"

    def __init__(self, inner: InferenceBackend, nth: int, k: int):
        self.inner, self.nth, self.k, self.calls = inner, nth, k, 0

    @property
    def version(self) -> int:
        return self.inner.version

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        out = await self.inner.generate(request)
        self.calls += 1
        if self.calls == self.nth and self.k < len(out.token_ids):
            return GenerateOutput(out.token_ids[: self.k], out.logprobs[: self.k], out.versions[: self.k], "abort")
        return out

    def pause(self) -> None:
        self.inner.pause()

    def resume(self) -> None:
        self.inner.resume()

    def update_weights(self, named_tensors, version: int) -> None:
        self.inner.update_weights(named_tensors, version)


class FakePool:
    """Records what it was asked to judge; the score is 1.0 when the label appears in the response."""

    def __init__(self):
        self.judged: list[str] = []

    async def judge(self, sample: Sample) -> None:
        self.judged.append(sample.response)
        sample.reward = {"score": float(str(sample.label) in sample.response)}


def make_sample(tok, prompt: str, uid: int = 0, label=None, extra=None) -> Sample:
    ids = tok.encode(prompt, add_special_tokens=False)
    return Sample(uid=uid, group_id=0, task_name="t", prompt_ids=ids, prompt_text=prompt, label=label,
                  extra_info=extra if extra is not None else {"row": 1})


def chars(tok, text: str) -> list[int]:
    """Token ids of ``text`` one character at a time: what a model may emit, unlike tok.encode(text)."""
    out = []
    for c in text:
        ids = tok.encode(c, add_special_tokens=False)
        assert len(ids) == 1, (c, ids)
        out += ids
    return out


# ------------------------------------------------------------------------ a BPE chat model
def chat_bpe(corpus: list[str]):
    """A small byte-level BPE tokenizer trained on ``corpus`` here (no download), with Qwen-style chat
    specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<|im_end|>", "<|im_start|>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<pad>", unk_token="<unk>")


@pytest.fixture(scope="module")
def bpe():
    return chat_bpe(['<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>',
                     "<tool_response>\n408\n</tool_response> user assistant",
                     "The answer is 409. 1234 408 409 12*34+1"] * 40)


def hermes_loop(tok, backend, tools=None, pool=None, **cfg) -> MultiTurnAgentLoop:
    params = cfg.pop("sample_params", {"max_tokens": 400, "temperature": 1.0})
    config = MultiTurnConfig(sample_params=SampleParams(**params), tool_format=HermesFormatConfig(), **cfg)
    return MultiTurnAgentLoop(config, backend=backend, judge_pool=pool or FakePool(), tokenizer=tok,
                              eos_token_ids=[tok.eos_token_id], seed=7, salt="train:t",
                              tools=[Calculator()] if tools is None else tools)


def call_text(expr: str) -> str:
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "' + expr + '"}}</tool_call>'


THREE_TURNS = ["Let me compute. " + call_text("12*34"), call_text("408+1"), "The answer is 409."]


def three_turn_script(tok) -> list[list[int]]:
    return [chars(tok, text) + [tok.eos_token_id] for text in THREE_TURNS]


def test_three_turn_episode_is_the_exact_concatenation_of_model_and_tool_tokens(bpe):
    turns = three_turn_script(bpe)
    backend = ScriptedBackend(turns, bpe.eos_token_id, versions=[3, 4, 6])
    pool = FakePool()
    loop = hermes_loop(bpe, backend, pool=pool)
    sample = make_sample(bpe, "What is 12*34+1?", label="409")
    asyncio.run(loop.run_sample(sample))

    fmt = HermesFormatConfig()
    tool1 = bpe.encode(fmt.response_prefix + fmt.response_item.replace("{output}", "408") + fmt.response_suffix,
                       add_special_tokens=False)
    tool2 = bpe.encode(fmt.response_prefix + fmt.response_item.replace("{output}", "409") + fmt.response_suffix,
                       add_special_tokens=False)
    assert sample.response_ids == turns[0] + tool1 + turns[1] + tool2 + turns[2]
    assert sample.response_mask == [1] * len(turns[0]) + [0] * len(tool1) + [1] * len(turns[1]) + [0] * len(tool2) \
        + [1] * len(turns[2])
    lp = ScriptedBackend.logprob
    assert sample.logprobs == [lp(0, i) for i in range(len(turns[0]))] + [0.0] * len(tool1) \
        + [lp(1, i) for i in range(len(turns[1]))] + [0.0] * len(tool2) + [lp(2, i) for i in range(len(turns[2]))]
    # tool tokens carry the version of the turn that called the tool; staleness comes from model tokens
    assert sample.token_versions == [3] * (len(turns[0]) + len(tool1)) + [4] * (len(turns[1]) + len(tool2)) \
        + [6] * len(turns[2])
    assert sample.oldest_version() == 3
    assert (sample.status, sample.finish_reason) == (Status.COMPLETED, "stop")
    assert sample.reward == {"score": 1.0} and pool.judged == [sample.response]
    assert episode_stats(sample) | {"calls": None} == {"tool_calls": 2, "tool_errors": 0, "tool_timeouts": 0,
                                                       "tool_tokens": len(tool1) + len(tool2), "tool_tokens_cut": 0,
                                                       "calls": None, "done": "stop", "turns": 3}
    # the turns were requested with the whole transcript so far, never re-encoded text
    assert [r.prompt_ids for r in backend.requests] == [
        sample.prompt_ids, sample.prompt_ids + turns[0] + tool1, sample.prompt_ids + turns[0] + tool1 + turns[1] + tool2]

    # the training sequence is exactly that
    from rlcli.algo.advantage import GRPOAdvantage

    other = copy.deepcopy(sample)
    other.uid, other.reward = 1, {"score": 0.0}
    seqs, _ = __import__("rlcli.runner.sequences", fromlist=["x"]).sequences_from_groups(
        [Group(0, "t", [sample, other])], GRPOAdvantage(GRPOAdvantage.Config()))
    seq = seqs[0]
    assert seq.prompt_ids == sample.prompt_ids and seq.response_ids == sample.response_ids
    assert seq.response_mask == sample.response_mask and seq.rollout_logprobs == sample.logprobs
    assert seq.advantage > 0 > seqs[1].advantage

    # decoding and re-encoding the same text would NOT give these tokens back
    for skip in (False, True):
        text = bpe.decode(sample.response_ids, skip_special_tokens=skip)
        reencoded = bpe.encode(text, add_special_tokens=False)
        assert reencoded != sample.response_ids
        assert len(reencoded) < len(sample.response_ids)  # BPE merges what the model emitted piecewise
    assert bpe.encode(THREE_TURNS[0], add_special_tokens=False) != turns[0][:-1]


def test_without_return_logprob_the_episode_carries_no_logprobs_and_trains(bpe):
    turns = three_turn_script(bpe)
    loop = hermes_loop(bpe, ScriptedBackend(turns, bpe.eos_token_id, versions=[3, 4, 6]),
                       sample_params={"max_tokens": 400, "temperature": 1.0, "return_logprob": False})
    sample = make_sample(bpe, "What is 12*34+1?", label="409")
    asyncio.run(loop.run_sample(sample))
    assert (sample.status, sample.finish_reason) == (Status.COMPLETED, "stop") and sample.error is None
    assert len(sample.response_ids) > len(turns[0]) + len(turns[1]) + len(turns[2])  # tool tokens in between
    assert sample.logprobs == []  # no 0.0 for the tool tokens either: nothing to line them up with
    assert len(sample.token_versions) == len(sample.response_mask) == len(sample.response_ids)
    from rlcli.algo.advantage import GRPOAdvantage
    from rlcli.runner.sequences import sequences_from_groups

    other = copy.deepcopy(sample)
    other.uid, other.reward = 1, {"score": 0.0}
    seqs, _ = sequences_from_groups([Group(0, "t", [sample, other])], GRPOAdvantage(GRPOAdvantage.Config()))
    assert [s.rollout_logprobs for s in seqs] == [None, None]


def test_pause_in_the_middle_of_turn_two_resumes_exactly(bpe):
    turns = three_turn_script(bpe)
    full = make_sample(bpe, "q", label="409")
    asyncio.run(hermes_loop(bpe, ScriptedBackend(turns, bpe.eos_token_id)).run_sample(full))
    for k in (0, 1, 5, len(turns[1]) - 1):
        backend = ScriptedBackend(turns, bpe.eos_token_id)
        backend.abort = {1: k}
        loop = hermes_loop(bpe, backend)
        s = make_sample(bpe, "q", label="409")
        asyncio.run(loop.run_sample(s))
        assert (s.status, s.finish_reason, s.reward) == (Status.ABORTED, "abort", None)
        assert s.response_ids == full.response_ids[: len(s.response_ids)]
        assert s.response_mask[-k or len(s.response_mask):] == [1] * k
        s = Sample.from_dict(json.loads(json.dumps(s.to_dict())))  # through a checkpoint
        asyncio.run(loop.run_sample(s))
        for field in ("response_ids", "response_mask", "logprobs", "token_versions", "response", "finish_reason",
                      "status", "reward"):
            assert getattr(s, field) == getattr(full, field), (k, field)
        assert episode_stats(s) == episode_stats(full)
        # turn 2 was continued with the seed it started with
        seeds = [r.seed for r in backend.requests]
        assert seeds[1] == seeds[2] and len(set(seeds)) == 3


class GatedTool(Tool):
    """A calculator whose calls wait for a gate (to pause a rollout while a tool runs)."""

    name: ClassVar[str] = "calculator"

    def __init__(self):
        super().__init__(ToolConfig())
        self.gate: asyncio.Event | None = None
        self.calls = 0

    async def call(self, arguments):
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        return Calculator().evaluate(arguments["expression"])


def test_cancelled_while_the_tool_runs_then_resumed_runs_the_tool(bpe):
    turns = three_turn_script(bpe)
    full = make_sample(bpe, "q", label="409")
    asyncio.run(hermes_loop(bpe, ScriptedBackend(turns, bpe.eos_token_id)).run_sample(full))
    tool = GatedTool()
    loop = hermes_loop(bpe, ScriptedBackend(turns, bpe.eos_token_id), tools=[tool])
    s = make_sample(bpe, "q", label="409")

    async def interrupted():
        tool.gate = asyncio.Event()
        task = asyncio.ensure_future(loop.run_sample(s))
        while tool.calls == 0:
            await asyncio.sleep(0)
        task.cancel()  # what a produce strategy does to in-flight work at a weight sync
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(interrupted())
    assert s.response_ids == turns[0] and s.response_mask == [1] * len(turns[0])  # turn done, tool not appended
    assert episode_stats(s)["tool_calls"] == 0
    s.status, s.finish_reason = Status.ABORTED, "abort"
    tool.gate = None
    asyncio.run(loop.run_sample(s))
    assert s.response_ids == full.response_ids and s.response_mask == full.response_mask
    assert episode_stats(s) == episode_stats(full) and tool.calls == 3  # the interrupted call ran again


# ---------------------------------------------------------------------- stopping and budget
def test_max_turns_runs_the_last_call_then_stops(bpe):
    backend = ScriptedBackend(three_turn_script(bpe), bpe.eos_token_id)
    s = make_sample(bpe, "q", label="408")
    asyncio.run(hermes_loop(bpe, backend, max_turns=1).run_sample(s))
    assert (s.status, s.finish_reason) == (Status.COMPLETED, "tool_calls")
    assert count_turns(s.response_mask) == 1 and s.response_mask[-1] == 0 and "408" in s.response
    assert len(backend.requests) == 1 and episode_stats(s)["tool_calls"] == 1


def test_budget_covers_tool_tokens_and_is_never_exceeded(bpe):
    turns = three_turn_script(bpe)
    full = make_sample(bpe, "q")
    asyncio.run(hermes_loop(bpe, ScriptedBackend(turns, bpe.eos_token_id)).run_sample(full))
    n = len(full.response_ids)
    for budget in range(1, n):
        s = make_sample(bpe, "q")
        loop = hermes_loop(bpe, ScriptedBackend(turns, bpe.eos_token_id),
                           sample_params={"max_tokens": budget, "temperature": 1.0})
        asyncio.run(loop.run_sample(s))
        # the budget (model + tool tokens) cuts the same episode, wherever it falls
        assert s.response_ids == full.response_ids[:budget] and s.response_mask == full.response_mask[:budget]
        assert s.logprobs == full.logprobs[:budget] and s.token_versions == full.token_versions[:budget]
        assert (s.finish_reason, s.status) == ("length", Status.COMPLETED)
        inside_tool = full.response_mask[budget - 1] == 0 and full.response_mask[budget] == 0
        assert (episode_stats(s)["tool_tokens_cut"] > 0) == inside_tool


def test_max_tokens_per_turn_and_max_tool_response_tokens(bpe):
    turns = three_turn_script(bpe)
    s = make_sample(bpe, "q")
    asyncio.run(hermes_loop(bpe, ScriptedBackend(turns, bpe.eos_token_id), max_tokens_per_turn=10).run_sample(s))
    assert s.response_ids == turns[0][:10] and s.finish_reason == "length"  # no complete call: the episode ends
    s = make_sample(bpe, "q")
    asyncio.run(hermes_loop(bpe, ScriptedBackend(turns, bpe.eos_token_id), max_tool_response_tokens=4).run_sample(s))
    assert [sum(1 for _ in g) for g in _runs(s.response_mask, 0)] == [4, 4] and s.finish_reason == "stop"


def _runs(mask, value):
    import itertools

    return [list(g) for k, g in itertools.groupby(mask) if k == value]


# ---------------------------------------------------------------------- tool errors and formats
class Exploding(Tool):
    """Raises."""

    name: ClassVar[str] = "explode"

    def call(self, arguments):
        raise RuntimeError("kaboom")


def test_tool_errors_are_shown_to_the_model_and_counted(bpe):
    turn = chars(bpe, '<tool_call>{"name": "explode", "arguments": {}}</tool_call><tool_call>{"name": "nope"}'
                      '</tool_call><tool_call>not json</tool_call>' + call_text("1/0")) + [bpe.eos_token_id]
    backend = ScriptedBackend([turn, chars(bpe, "done") + [bpe.eos_token_id]], bpe.eos_token_id)
    s = make_sample(bpe, "q")
    asyncio.run(hermes_loop(bpe, backend, tools=[Calculator(), Exploding()],
                            sample_params={"max_tokens": 1000}).run_sample(s))
    tool_text = bpe.decode([t for t, m in zip(s.response_ids, s.response_mask) if m == 0])
    assert tool_text.count("<tool_response>") == 4
    assert "error: RuntimeError: kaboom" in tool_text and "error: unknown tool 'nope'; available: calculator, explode" \
        in tool_text and "error: tool call is not valid JSON" in tool_text and "error: division by zero" in tool_text
    st = episode_stats(s)
    assert (st["tool_calls"], st["tool_errors"], st["turns"], s.finish_reason) == (4, 4, 2, "stop")
    assert st["calls"] == {"explode": 1, "nope": 1, "?": 1, "calculator": 1}
    m = rollout_metrics([s])
    assert m["tool/calls_mean"] == 4 and m["tool/error_rate"] == 1.0 and m["tool/turns_mean"] == 2


def test_hermes_format_parsing():
    f = HermesFormat(HermesFormatConfig(max_calls_per_turn=2))
    calls = f.parse('a <tool_call>{"name": "x", "arguments": {"k": 1}}</tool_call> b '
                    '<tool_call>\n{"name": "y", "arguments": "{\\"z\\": 2}"}\n</tool_call>'
                    '<tool_call>{"name": "w"}</tool_call> <tool_call>{"name"', "")
    assert [(c.name, c.arguments, c.error) for c in calls[:2]] == [("x", {"k": 1}, None), ("y", {"z": 2}, None)]
    assert [c.error for c in calls[2:]] == ["at most 2 tool calls per turn"] * 2
    assert [c.error for c in f.parse('<tool_call>{"name": "x"}</tool_call> <tool_call>{"name"', "")] == [
        None, "unterminated tool call (no </tool_call>)"]
    assert f.parse("no calls here", "") == []
    bad = f.parse('<tool_call>["x"]</tool_call><tool_call>{"name": "x", "arguments": 3}</tool_call>', "")
    assert [c.error is not None for c in bad] == [True, True]
    text = f.render([ToolResult("x", "1"), ToolResult("y", "2", "error")])
    assert text == "\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>" \
                   "<|im_end|>\n<|im_start|>assistant\n"


def test_line_format_evaluates_the_current_line():
    tok = load_tokenizer("builtin:calc")
    f = LineFormat(LineFormatConfig(error_template="?\n"), tok)
    assert f.stop_token_ids() == tok.encode("\n", add_special_tokens=False)
    assert f.parse("\n", "37*482") == [ToolCall("calculator", {"expression": "37*482"})]
    assert f.parse("+1\n", "12\n37*482") == [ToolCall("calculator", {"expression": "37*482+1"})]
    assert f.parse("17834", "37*482") == []
    assert f.render([ToolResult("calculator", "17834")]) == "17834\n"
    assert f.render([ToolResult("calculator", "error: empty expression", "error")]) == "?\n"
    with pytest.raises(ValueError, match="exactly one token"):
        LineFormat(LineFormatConfig(newline="ab"), tok)


def test_toy_episode_with_the_line_format():
    tok = load_tokenizer("builtin:calc")
    eos = tok.eos_token_id
    nl = chars(tok, "\n")
    backend = ScriptedBackend([nl, nl, [eos]], eos)
    cfg = MultiTurnConfig(sample_params=SampleParams(max_tokens=12), max_turns=3,
                          tool_format=LineFormatConfig(error_template="?\n"))
    pool = JudgePool(ExactMatchJudger(ExactMatchConfig(executor="inline")))
    loop = MultiTurnAgentLoop(cfg, backend=backend, judge_pool=pool, tokenizer=tok, eos_token_ids=[eos], seed=1,
                              tools=[Calculator()])
    s = make_sample(tok, "37*482", label="17834")
    asyncio.run(loop.run_sample(s))
    # "\n" evaluates the question, the second "\n" an empty line (an error, shown as "?")
    assert tok.decode(s.response_ids) == "\n17834\n\n?\n<eos>" and s.response == "\n17834\n\n?\n"
    assert s.reward["score"] == 0.0 and episode_stats(s)["tool_errors"] == 1
    backend = ScriptedBackend([nl, [eos]], eos)
    loop = MultiTurnAgentLoop(cfg, backend=backend, judge_pool=pool, tokenizer=tok, eos_token_ids=[eos], seed=1,
                              tools=[Calculator()])
    s = make_sample(tok, "37*482", label="17834")
    asyncio.run(loop.run_sample(s))
    assert s.response == "\n17834\n" and s.reward["score"] == 1.0 and s.response_mask == [1] + [0] * 6 + [1]
    assert backend.requests[0].params.stop_token_ids == nl  # the newline ends a turn


def test_response_text_final_turn(bpe):
    backend = ScriptedBackend(three_turn_script(bpe), bpe.eos_token_id)
    pool = FakePool()
    s = make_sample(bpe, "q", label="409")
    asyncio.run(hermes_loop(bpe, backend, pool=pool, response_text="final_turn").run_sample(s))
    assert s.response == THREE_TURNS[2] and pool.judged == [THREE_TURNS[2]]


# ---------------------------------------------------------------------- bookkeeping
def test_state_is_per_sample_and_reset_on_reroll(bpe):
    row = {"row": 1}
    group = [make_sample(bpe, "q", uid=i, label="409", extra=row) for i in range(2)]
    loop = hermes_loop(bpe, ScriptedBackend(three_turn_script(bpe), bpe.eos_token_id))
    asyncio.run(loop.run_sample(group[0]))
    assert row == {"row": 1} and STATE_KEY not in group[1].extra_info  # the dataset row is not touched
    assert group[0].extra_info["row"] == 1 and group[0].extra_info[STATE_KEY]["tool_calls"] == 2
    s = group[0]
    s.tries += 1
    s.reset_response()
    backend = ScriptedBackend([chars(bpe, "no tools") + [bpe.eos_token_id]], bpe.eos_token_id)
    asyncio.run(hermes_loop(bpe, backend).run_sample(s))
    assert episode_stats(s)["tool_calls"] == 0 and episode_stats(s)["done"] == "stop"


def test_turn_seed_depends_on_saved_fields_only(bpe):
    s = make_sample(bpe, "q")
    a = turn_seed(1, s, "train:t", 10)
    s.response_ids, s.resumes, s.staleness = [5] * 30, 4, 2
    assert turn_seed(1, s, "train:t", 10) == a
    s.tries += 1
    assert turn_seed(1, s, "train:t", 10) != a and turn_seed(1, s, "train:t", 11) != turn_seed(1, s, "train:t", 10)


def test_completed_sample_is_left_alone_and_judged_state_is_reused(bpe):
    backend = ScriptedBackend(three_turn_script(bpe), bpe.eos_token_id)
    pool = FakePool()
    loop = hermes_loop(bpe, backend, pool=pool)
    s = make_sample(bpe, "q", label="409")
    asyncio.run(loop.run_sample(s))
    n = len(backend.requests)
    asyncio.run(loop.run_sample(s))
    assert len(backend.requests) == n and len(pool.judged) == 1
    # a judge call cut by a pause: the episode is over, only the judging is redone
    s.status, s.finish_reason, s.reward = Status.ABORTED, "abort", None
    asyncio.run(loop.run_sample(s))
    assert len(backend.requests) == n and s.reward == {"score": 1.0} and s.finish_reason == "stop"


def test_backend_errors_fail_the_sample(bpe):
    class Failing(ScriptedBackend):
        async def generate(self, request):
            return GenerateOutput([], [], [], "error", "engine exploded")

    s = make_sample(bpe, "q")
    asyncio.run(hermes_loop(bpe, Failing([], bpe.eos_token_id)).run_sample(s))
    assert (s.status, s.error, s.finish_reason) == (Status.FAILED, "engine exploded", "error")


def test_hermes_system_prompt_lists_tools():
    text = hermes_system_prompt([Calculator], intro="Solve it.")
    assert text.startswith("Solve it.\n\n# Tools") and '"name": "calculator"' in text and "<tool_call>" in text


# ---------------------------------------------------------------------- recipe validation
def test_tools_are_validated_with_their_paths(repo):
    import yaml

    from rlcli.config import RecipeError, validate_recipe

    raw = yaml.safe_load((repo / "recipes" / "tool-calculator.yaml").read_text())
    rec = validate_recipe(copy.deepcopy(raw), base_dir=repo / "recipes")
    assert rec.tasks[0].agent_loop.cls is MultiTurnAgentLoop
    bad = copy.deepcopy(raw)
    loop = bad["tasks"][0]["agent_loop"]
    loop["tools"] = [{"name": "calculater"}, {"name": "calculator", "max_exponent": -1, "colour": 1}]
    with pytest.raises(RecipeError) as e:
        validate_recipe(bad, base_dir=repo / "recipes")
    msgs = [str(i) for i in e.value.issues]
    assert any(m.startswith("tasks.0.agent_loop.tools.0.name: unknown tool 'calculater'") and "did you mean 'calculator'"
               in m for m in msgs), msgs
    assert any(m.startswith("tasks.0.agent_loop.tools.1.max_exponent:") for m in msgs), msgs
    assert any(m.startswith("tasks.0.agent_loop.tools.1.colour:") for m in msgs), msgs
    bad = copy.deepcopy(raw)
    bad["tasks"][0]["agent_loop"]["tools"] = []
    bad["tasks"][0]["agent_loop"]["tool_format"] = {"name": "line", "response_template": "{output}", "error_template": ""}
    with pytest.raises(RecipeError) as e:
        validate_recipe(bad, base_dir=repo / "recipes")
    msgs = "\n".join(str(i) for i in e.value.issues)
    assert "tasks.0.agent_loop.tool_format.tool: the line format calls tool 'calculator', which is not in tools" in msgs
    assert "tool_format.error_template" in msgs
    bad["tasks"][0]["agent_loop"]["tool_format"] = {"name": "xml"}
    with pytest.raises(RecipeError, match="tool_format"):
        validate_recipe(bad, base_dir=repo / "recipes")
