"""The ``multi_turn`` agent loop: the model calls tools, sees their output, and continues.

An episode alternates *model turns* and *tool responses* inside one response::

    prompt | model turn 1 | tool response 1 | model turn 2 | ... | final model turn

Everything is kept as token ids, never as re-tokenized text: a model turn's tokens are the
backend's ids with their logprobs and policy versions (``response_mask`` 1, trained on); a tool
response is the tool output wrapped in the format's template, tokenized once (special-token text
in an output stays text: :func:`encode_tool_response`) and appended with ``response_mask`` 0,
logprob 0.0 and - as its policy version - the version of the last model token before it (the
turn that called the tool). Tool tokens are therefore never older than the model tokens before
them, so a sample's staleness (its oldest token version) is that of its oldest *model* token,
and they are never trained on whatever their version.

**Tool calls.** The last model turn's text is parsed by the configured *tool-call format*
(``tool_format``), a swappable part (:class:`ToolCallFormat`; subclasses of
:class:`MultiTurnAgentLoop` may return their own from :meth:`MultiTurnAgentLoop.make_format`):

* ``hermes`` (default; Qwen2.5/Qwen3, Hermes): calls are ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`` anywhere in the turn (several per turn run concurrently; results keep
  the call order). The results are appended as the chat template renders tool messages -
  ``\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n``
  (every piece is configurable for other chat formats). A call that is not valid JSON, not an
  object with a string ``name`` or not closed is answered with an ``error: ...`` text.
* ``line`` (toy models with a character-level tokenizer): the transcript is a calculator tape.
  A model turn that ends with the newline token (a stop token) calls one tool (``calculator``)
  with the *current line* - the text since the previous newline of prompt and response, so a
  question the prompt leaves on the line is evaluated when the model "presses Enter" - and the
  output is appended as ``{output}\\n`` (a failed call can be shown as ``error_template``
  instead). A turn that ends with EOS is the final answer.

**Stopping.** The episode ends with the first of: a model turn without a tool call
(``finish_reason`` ``stop``, or ``length`` if that turn was cut by ``max_tokens_per_turn``);
``max_turns`` model turns each of which called a tool - the last call still runs, as in XTuner
(``tool_calls``); the token budget (``length``). ``sample_params.max_tokens`` is the budget of
the *whole* response, model and tool tokens together, and is never exceeded: a model turn may
generate at most what is left, and a tool response that does not fit is cut to fit (then the
episode ends).

**Partial rollout.** A pause aborts the turn being generated: the sample becomes ABORTED with
every token so far (model tokens of the interrupted turn included). Calling :meth:`run_sample`
again continues exactly where it stopped, deciding from the saved tokens alone: inside a model
turn (its last token is not a stop token and no limit is reached) it continues generating; at
the end of a model turn that called a tool whose response is not appended yet, it runs the
tool; after a tool response it starts the next turn. Each turn is sampled with a seed derived
from saved fields only (run seed, salt, task, uid, ``tries`` and the offset where the turn
starts, see :func:`turn_seed`), and backends draw per (seed, absolute position), so a continued
episode yields the same tokens and masks as an uninterrupted one.

**Metadata.** Per-sample counters live in ``sample.extra_info["multi_turn"]`` (checkpointed with
the sample): ``tool_calls``, ``tool_errors``, ``tool_timeouts``, ``tool_tokens``, ``calls`` (per
tool name) and ``done`` (the final reason once the episode ended); :func:`episode_stats` adds
the number of model turns, and :func:`rollout_metrics` reduces a batch of samples to the
``tool/*`` scalars a runner logs.
"""

from __future__ import annotations

import asyncio
import hashlib
import statistics
import time
from typing import Annotated, Any, ClassVar, Iterable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from rlcli.agent_loops.base import AgentLoop, AgentLoopConfig
from rlcli.agent_loops.tool_formats import (  # re-exported: this module was their home
    FORMATS,
    HermesFormat,
    HermesFormatConfig,
    LineFormat,
    LineFormatConfig,
    ToolCall,
    ToolCallFormat,
    ToolFormatConfig,
    _OUTPUT,
    encode_tool_response,
    hermes_system_prompt,
)
from rlcli.backends.base import GenerateRequest, InferenceBackend
from rlcli.component import ChecksConfig
from rlcli.hookspecs import Kind
from rlcli.tokenizer import decode_tokens
from rlcli.tools.base import Tool, ToolResult, error_text
from rlcli.types import Sample, Status, status_from_finish_reason

STATE_KEY = "multi_turn"
"""Key of the per-sample counters in ``Sample.extra_info``."""

def turn_seed(run_seed: int, sample: Sample, salt: str, turn_start: int) -> int:
    """The sampling seed of the model turn that starts at response offset ``turn_start``.

    A function of saved fields only, and the same for every request of one turn (its first
    request and any continuation after a pause), so a continued turn draws what it would have
    drawn uninterrupted.
    """
    key = f"{run_seed}:{salt}:{sample.task_name}:{sample.uid}:{sample.tries}:turn@{turn_start}"
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") & ((1 << 62) - 1)


# ------------------------------------------------------------------------------- config
class ToolSpec(BaseModel):
    """``{name: <registered tool>, **its options}``."""

    model_config = ConfigDict(extra="allow")
    name: str

    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class MultiTurnConfig(AgentLoopConfig):
    max_turns: int = Field(4, gt=0, description="Most model turns per episode (each but the last may call tools).")
    max_tokens_per_turn: int | None = Field(
        None, gt=0,
        description="Cut a single model turn at this many tokens (sample_params.max_tokens bounds the whole response).")
    tool_format: ToolFormatConfig = Field(  # type: ignore[valid-type]
        default_factory=HermesFormatConfig,
        description="How calls are parsed and results shown: {name: hermes|line, ...}.")
    tools: list[Annotated[ToolSpec, Kind("tool")]] = Field(
        default_factory=list, description="Registered tools the model may call: [{name: calculator, ...options}].")
    max_tool_response_tokens: int | None = Field(
        None, gt=0, description="Cut one tool response to this many tokens (the budget may cut it further).")
    parallel_tool_calls: bool = Field(
        True, description="Run the calls of one turn concurrently (results keep call order).")
    response_text: Literal["all", "final_turn"] = Field(
        "all", description="What the judger sees as the response: the whole decoded response (model and tool "
        "text, as XTuner) or only the last model turn.")

    _resolved_tools: list[tuple[type, Any]] | None = PrivateAttr(None)


def _template_problems(fmt: BaseModel) -> list[tuple[str, str]]:
    out = []
    if isinstance(fmt, LineFormatConfig):
        if _OUTPUT not in fmt.response_template:
            out.append(("tool_format.response_template", "must contain {output}"))
        if not fmt.response_template.replace(_OUTPUT, ""):
            out.append(("tool_format.response_template", "needs text besides {output} (e.g. a newline), so that "
                        "every tool response has at least one token"))
        if fmt.error_template is not None and not fmt.error_template.replace(_OUTPUT, ""):
            out.append(("tool_format.error_template", "needs text besides {output}, so that every tool response "
                        "has at least one token"))
    elif isinstance(fmt, HermesFormatConfig):
        if _OUTPUT not in fmt.response_item:
            out.append(("tool_format.response_item", "must contain {output}"))
        if not (fmt.response_prefix + fmt.response_suffix + fmt.response_item.replace(_OUTPUT, "")):
            out.append(("tool_format.response_prefix", "the tool response template has no text besides {output}"))
    return out


# --------------------------------------------------------------------------------- loop
class MultiTurnAgentLoop(AgentLoop):
    """Model turns and tool calls on token ids, with partial rollout across turns."""

    name: ClassVar[str] = "multi_turn"
    Config: ClassVar[type[MultiTurnConfig]] = MultiTurnConfig
    config: MultiTurnConfig

    @classmethod
    def check_config(cls, cfg: MultiTurnConfig, registry=None) -> list[tuple[str, str]]:
        """Resolve ``tools`` against the registry (reported with their paths by ``rlcli validate``)."""
        from pydantic import ValidationError

        from rlcli.plugins import PluginError, get_registry

        registry = registry or get_registry()
        issues: list[tuple[str, str]] = []
        resolved: list[tuple[type, Any]] = []
        seen: dict[str, int] = {}
        for i, spec in enumerate(cfg.tools):
            if spec.name in seen:
                issues.append((f"tools.{i}.name", f"tool {spec.name!r} is listed twice (also tools.{seen[spec.name]})"))
                continue
            seen[spec.name] = i
            try:
                tcls = registry.get("tool", spec.name)
            except PluginError as exc:
                issues.append((f"tools.{i}.name", str(exc)))
                continue
            try:
                tcfg = tcls.Config.model_validate(spec.options())
            except ValidationError as exc:
                for err in exc.errors():
                    loc = ".".join(str(p) for p in err["loc"])
                    where = f"tools.{i}.{loc}" if loc else f"tools.{i}"
                    issues.append((where, f"{err['msg']} (options of tool {spec.name!r})"))
                continue
            checks = tcls.check_config(tcfg) if isinstance(tcls, ChecksConfig) else []  # e.g. python's strict
            issues += [(f"tools.{i}.{f}", f"{msg} (options of tool {spec.name!r})") for f, msg in checks or []]
            resolved.append((tcls, tcfg))
        fmt = cfg.tool_format
        if isinstance(fmt, LineFormatConfig) and fmt.tool not in seen:
            issues.append(("tool_format.tool", f"the line format calls tool {fmt.tool!r}, which is not in tools "
                           f"({', '.join(seen) or 'none configured'})"))
        issues += _template_problems(fmt)
        if not issues:
            cfg._resolved_tools = resolved
        return issues

    def __init__(self, config: MultiTurnConfig, *, backend: InferenceBackend, judge_pool: Any, tokenizer: Any,
                 eos_token_ids: list[int], seed: int, salt: str = "", tools: Iterable[Tool] | None = None):
        super().__init__(config, backend=backend, judge_pool=judge_pool, tokenizer=tokenizer,
                         eos_token_ids=eos_token_ids, seed=seed, salt=salt)
        self.tools: dict[str, Tool] = {t.name: t for t in (tools if tools is not None else self._build_tools())}
        self.format = self.make_format()
        p = config.sample_params
        self._format_stops = [t for t in self.format.stop_token_ids() if t not in p.stop_token_ids]
        self._stop_set = set(p.stop_token_ids) | set(self._format_stops) | (set() if p.ignore_eos else self.eos)

    def _build_tools(self) -> list[Tool]:
        cfg = self.config
        if cfg._resolved_tools is None:
            problems = type(self).check_config(cfg)
            if problems:
                raise ValueError("; ".join(f"{path}: {msg}" for path, msg in problems))
        return [tcls(tcfg) for tcls, tcfg in cfg._resolved_tools or []]

    def make_format(self) -> ToolCallFormat:
        """The tool-call format of this loop; override to plug in another syntax."""
        fmt = self.config.tool_format
        problems = _template_problems(fmt)
        if problems:
            raise ValueError("; ".join(f"{path}: {msg}" for path, msg in problems))
        return FORMATS[fmt.name](fmt, self.tokenizer)

    def close(self) -> None:
        for tool in self.tools.values():
            tool.close()

    # -------------------------------------------------------------------------- episode
    async def run_sample(self, sample: Sample) -> Sample:
        if sample.status == Status.COMPLETED:  # a fresh sibling kept from an expired group
            return sample
        p = self.config.sample_params
        sample.temperature = p.temperature if p.temperature > 0 else 1.0
        state = _state(sample)
        reason = state.get("done")
        while reason is None:
            reason = await self._advance(sample, state)
        if reason == "abort":
            sample.status, sample.finish_reason = Status.ABORTED, "abort"
            return sample
        state["done"] = reason
        sample.finish_reason = reason
        sample.status = status_from_finish_reason(reason)
        sample.response = self._response_text(sample)
        if sample.status == Status.COMPLETED:
            await self.judge_pool.judge(sample)
        return sample

    async def _advance(self, sample: Sample, state: dict[str, Any]) -> str | None:
        """One step of the episode, decided from the saved tokens; returns the final reason or None."""
        budget = self.config.sample_params.max_tokens
        n = len(sample.response_ids)
        start = _turn_start(sample.response_mask)
        if n > start:  # the response ends inside or at the end of a model turn
            end = self._turn_end(sample, start)
            if end is None:
                return await self._generate(sample, start)
            calls = self._parse(sample, start)
            if not calls:
                return end
            if n >= budget:
                return "length"
            return await self._run_calls(sample, state, calls)
        if n >= budget:
            return "length"
        if count_turns(sample.response_mask) >= self.config.max_turns:
            return "tool_calls"
        return await self._generate(sample, n)

    def _turn_end(self, sample: Sample, start: int) -> str | None:
        """How the model turn starting at ``start`` ended, or None if it was interrupted."""
        n = len(sample.response_ids)
        if sample.response_ids[-1] in self._stop_set:
            return "stop"
        cap = self.config.max_tokens_per_turn
        if n >= self.config.sample_params.max_tokens or (cap is not None and n - start >= cap):
            return "length"
        return None

    async def _generate(self, sample: Sample, start: int) -> str | None:
        p = self.config.sample_params
        n = len(sample.response_ids)
        done = n - start  # tokens of this turn generated before a pause
        max_new = p.max_tokens - n
        if self.config.max_tokens_per_turn is not None:
            max_new = min(max_new, self.config.max_tokens_per_turn - done)
        params = p.model_copy(update={
            "max_tokens": max_new,
            "min_tokens": min(max(p.min_tokens - done, 0), max_new),
            "stop_token_ids": list(p.stop_token_ids) + self._format_stops,
        })
        t0 = time.perf_counter()
        out = await self.backend.generate(GenerateRequest(
            prompt_ids=sample.prompt_ids + sample.response_ids, params=params, request_id=sample.uid,
            seed=turn_seed(self.seed, sample, self.salt, start),
        ))
        sample.gen_time_s += time.perf_counter() - t0
        k = len(out.token_ids)
        if len(out.versions) != k or (len(out.logprobs) != k and (out.logprobs or params.return_logprob)):
            sample.error = (f"backend returned {k} tokens with {len(out.logprobs)} logprobs and "
                            f"{len(out.versions)} versions")
            return "error"
        sample.response_ids += out.token_ids
        sample.logprobs += out.logprobs
        sample.token_versions += out.versions
        sample.response_mask += [1] * k
        if out.error:
            sample.error = out.error
        if out.finish_reason == "abort":
            return "abort"
        if out.finish_reason not in ("stop", "length"):
            return out.finish_reason or "error"
        if k == 0 or (out.finish_reason == "length" and self._turn_end(sample, start) is None):
            # nothing generated, or the backend's own context limit cut the turn: the episode ends here
            return out.finish_reason
        return None

    def _parse(self, sample: Sample, start: int) -> list[ToolCall]:
        ids = sample.response_ids[start:]
        if ids and ids[-1] in self.eos:
            ids = ids[:-1]
        turn_text = decode_tokens(self.tokenizer, ids, skip_special_tokens=not self.format.keep_special_tokens)
        context = decode_tokens(self.tokenizer, sample.prompt_ids + sample.response_ids[:start])
        return self.format.parse(turn_text, context)

    async def _call(self, call: ToolCall) -> ToolResult:
        if call.error is not None:
            return ToolResult(call.name or "?", error_text(call.error), "error")
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(call.name, error_text(f"unknown tool {call.name!r}; available: "
                                                    f"{', '.join(sorted(self.tools)) or 'none'}"), "error")
        return await tool.run(call.arguments)

    async def _run_calls(self, sample: Sample, state: dict[str, Any], calls: list[ToolCall]) -> str | None:
        if self.config.parallel_tool_calls and len(calls) > 1:
            results = list(await asyncio.gather(*(self._call(c) for c in calls)))
        else:
            results = [await self._call(c) for c in calls]
        ids = encode_tool_response(self.tokenizer, self.format, results)
        if not ids:
            sample.error = "the tool response rendered to no tokens"
            return "error"
        room = self.config.sample_params.max_tokens - len(sample.response_ids)
        if self.config.max_tool_response_tokens is not None:
            room = min(room, self.config.max_tool_response_tokens)
        cut = max(0, len(ids) - room)
        ids = ids[:room]
        version = sample.token_versions[-1] if sample.token_versions else self.backend.version
        # tokens and counters change together, with no await in between (a pause cannot split them)
        sample.response_ids += ids
        if sample.logprobs or self.config.sample_params.return_logprob:  # else the sample holds none
            sample.logprobs += [0.0] * len(ids)
        sample.token_versions += [version] * len(ids)
        sample.response_mask += [0] * len(ids)
        state["tool_calls"] += len(results)
        state["tool_errors"] += sum(r.status == "error" for r in results)
        state["tool_timeouts"] += sum(r.status == "timeout" for r in results)
        state["tool_tokens"] += len(ids)
        state["tool_tokens_cut"] += cut
        for r in results:
            state["calls"][r.name] = state["calls"].get(r.name, 0) + 1
        return None

    def _response_text(self, sample: Sample) -> str:
        ids = sample.response_ids
        if self.config.response_text == "final_turn":
            ids = ids[_turn_start(sample.response_mask):] if sample.response_mask and sample.response_mask[-1] else []
        return decode_tokens(self.tokenizer, ids)

    # -------------------------------------------------------------------------- metrics
    @staticmethod
    def rollout_metrics(samples: Iterable[Sample]) -> dict[str, float]:
        """The ``tool/*`` scalars of a batch (see :func:`rollout_metrics`), for the runner to log."""
        return rollout_metrics(samples)


# ---------------------------------------------------------------------- episode helpers
def _turn_start(mask: Sequence[int]) -> int:
    """Offset of the current model turn: just after the last tool token (0 if there is none)."""
    for i in range(len(mask) - 1, -1, -1):
        if not mask[i]:
            return i + 1
    return 0


def count_turns(mask: Sequence[int]) -> int:
    """Model turns in a response: runs of trained (mask 1) tokens."""
    turns, prev = 0, 0
    for m in mask:
        if m and not prev:
            turns += 1
        prev = m
    return turns


def _fresh_state() -> dict[str, Any]:
    return {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "tool_tokens": 0, "tool_tokens_cut": 0,
            "calls": {}, "done": None}


def _state(sample: Sample) -> dict[str, Any]:
    """The sample's episode counters (new ones for an empty response, e.g. after a re-roll).

    ``extra_info`` is shared by the samples of a group (it comes from the dataset row), so the
    sample gets its own copy of the dict before its counters are added.
    """
    current = sample.extra_info.get(STATE_KEY) if isinstance(sample.extra_info, dict) else None
    if sample.response_ids and isinstance(current, dict):
        state = {**_fresh_state(), **current}
        state["calls"] = dict(state["calls"])
    else:
        state = _fresh_state()
    sample.extra_info = {**(sample.extra_info or {}), STATE_KEY: state}
    return state


def episode_stats(sample: Sample) -> dict[str, Any] | None:
    """The multi-turn counters of a sample plus ``turns`` (model turns); None for other loops."""
    state = sample.extra_info.get(STATE_KEY) if isinstance(sample.extra_info, dict) else None
    if not isinstance(state, dict):
        return None
    return {**state, "turns": count_turns(sample.response_mask)}


def rollout_metrics(samples: Iterable[Sample]) -> dict[str, float]:
    """``tool/*`` scalars over the COMPLETED multi-turn samples of a batch ({} if there are none).

    ``tool/turns_mean`` (model turns per episode), ``tool/calls_mean``, ``tool/errors_mean``,
    ``tool/error_rate`` (errors and timeouts per call), ``tool/timeouts``, ``tool/call_frac``
    (episodes with at least one call), ``tool/max_turns_frac`` (episodes stopped by max_turns),
    ``tool/token_frac`` (share of response tokens that are tool output), ``tool/tokens_cut``, and
    ``tool/calls/<tool>`` (calls per tool).
    """
    stats = [(s, st) for s in samples if s.status == Status.COMPLETED and (st := episode_stats(s)) is not None]
    if not stats:
        return {}
    calls = sum(st["tool_calls"] for _, st in stats)
    bad = sum(st["tool_errors"] + st["tool_timeouts"] for _, st in stats)
    tokens = sum(len(s.response_ids) for s, _ in stats)
    out = {
        "tool/turns_mean": statistics.fmean(st["turns"] for _, st in stats),
        "tool/calls_mean": statistics.fmean(st["tool_calls"] for _, st in stats),
        "tool/errors_mean": statistics.fmean(st["tool_errors"] + st["tool_timeouts"] for _, st in stats),
        "tool/error_rate": bad / calls if calls else 0.0,
        "tool/timeouts": float(sum(st["tool_timeouts"] for _, st in stats)),
        "tool/call_frac": statistics.fmean(float(st["tool_calls"] > 0) for _, st in stats),
        "tool/max_turns_frac": statistics.fmean(float(s.finish_reason == "tool_calls") for s, _ in stats),
        "tool/token_frac": sum(st["tool_tokens"] for _, st in stats) / tokens if tokens else 0.0,
        "tool/tokens_cut": float(sum(st["tool_tokens_cut"] for _, st in stats)),
    }
    for name in sorted({name for _, st in stats for name in st["calls"]}):
        out[f"tool/calls/{name}"] = float(sum(st["calls"].get(name, 0) for _, st in stats))
    return out
