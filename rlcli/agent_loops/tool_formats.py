"""Tool-call formats of the ``multi_turn`` agent loop: how calls look in the model's text and how
tool output is shown to it (``tool_format``: ``hermes``, ``line``), and the encoding of a rendered
tool response, in which special-token text a tool printed stays text.
"""

from __future__ import annotations

import abc
import json
import re
from dataclasses import dataclass, replace
from typing import Annotated, Any, ClassVar, Iterable, Literal, Union

from pydantic import Field

from rlcli.component import ComponentConfig
from rlcli.tools.base import Tool, ToolResult

_OUTPUT = "{output}"


@dataclass
class ToolCall:
    """One parsed call. ``error`` is set when the call text could not be understood."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


class ToolCallFormat(abc.ABC):
    """How tool calls look in the model's text and how tool output is shown to the model."""

    keep_special_tokens: ClassVar[bool] = False  # decode turns with special tokens (for parsing)

    def stop_token_ids(self) -> list[int]:
        """Extra token ids that end a model turn (besides EOS and ``sample_params.stop_token_ids``)."""
        return []

    @abc.abstractmethod
    def parse(self, turn_text: str, context_text: str) -> list[ToolCall]:
        """The tool calls of one finished model turn (``[]``: the turn is a final answer).

        ``turn_text`` is the decoded turn (without its trailing EOS); ``context_text`` is the
        decoded prompt and response before the turn.
        """

    @abc.abstractmethod
    def render(self, results: list[ToolResult]) -> str:
        """The text appended after the turn for these results (tokenized once, mask 0)."""


class HermesFormatConfig(ComponentConfig):
    """``<tool_call>{json}</tool_call>`` calls; results as Qwen-style tool messages."""

    name: Literal["hermes"] = "hermes"
    call_open: str = Field("<tool_call>", min_length=1, description="Text that opens a call.")
    call_close: str = Field("</tool_call>", min_length=1, description="Text that closes a call.")
    response_prefix: str = Field("\n<|im_start|>user", description="Before the first tool result.")
    response_item: str = Field("\n<tool_response>\n{output}\n</tool_response>",
                               description="One tool result; {output} is replaced by the tool output.")
    response_suffix: str = Field("<|im_end|>\n<|im_start|>assistant\n",
                                 description="After the last result: closes the tool message, opens the next turn.")
    max_calls_per_turn: int = Field(8, gt=0, description="Further calls in one turn are answered with an error.")


class LineFormatConfig(ComponentConfig):
    """A calculator tape: a turn ending with a newline evaluates the current line."""

    name: Literal["line"] = "line"
    tool: str = Field("calculator", description="The tool a newline calls.")
    argument: str = Field("expression", description="The argument the current line is passed as.")
    newline: str = Field("\n", min_length=1, description="The text of the (single) token that ends a calling turn.")
    response_template: str = Field("{output}\n", description="Appended after the call; {output} is the tool output.")
    error_template: str | None = Field(
        None, description="Appended instead when the call failed ({output}: the error text); null: response_template. "
        "E.g. '?\\n' for a tokenizer that cannot spell error messages.")


ToolFormatConfig = Annotated[Union[HermesFormatConfig, LineFormatConfig], Field(discriminator="name")]


class HermesFormat(ToolCallFormat):
    keep_special_tokens = True  # <tool_call> may be a special token in some vocabularies

    def __init__(self, cfg: HermesFormatConfig, tokenizer: Any = None):
        self.cfg = cfg
        self._re = re.compile(re.escape(cfg.call_open) + r"(.*?)" + re.escape(cfg.call_close), re.S)

    def parse(self, turn_text: str, context_text: str) -> list[ToolCall]:
        calls: list[ToolCall] = []
        end = 0
        for m in self._re.finditer(turn_text):
            end = m.end()
            calls.append(self._parse_one(m.group(1)))
        if self.cfg.call_open in turn_text[end:]:
            calls.append(ToolCall("", {}, f"unterminated tool call (no {self.cfg.call_close})"))
        limit = self.cfg.max_calls_per_turn
        for c in calls[limit:]:
            c.error = f"at most {limit} tool calls per turn"
        return calls

    @staticmethod
    def _parse_one(body: str) -> ToolCall:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            return ToolCall("", {}, f"tool call is not valid JSON ({exc.msg} at char {exc.pos})")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ToolCall("", {}, 'a tool call must be a JSON object {"name": ..., "arguments": {...}}')
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models send the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return ToolCall(obj["name"], {}, "tool call arguments are not valid JSON")
        if not isinstance(args, dict):
            return ToolCall(obj["name"], {}, "tool call arguments must be a JSON object")
        return ToolCall(obj["name"], args)

    def render(self, results: list[ToolResult]) -> str:
        items = "".join(self.cfg.response_item.replace(_OUTPUT, r.output) for r in results)
        return self.cfg.response_prefix + items + self.cfg.response_suffix


class LineFormat(ToolCallFormat):
    def __init__(self, cfg: LineFormatConfig, tokenizer: Any):
        self.cfg = cfg
        ids = tokenizer.encode(cfg.newline, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"tool_format 'line': newline {cfg.newline!r} must be exactly one token of the "
                             f"tokenizer, it is {len(ids)} ({ids})")
        self._stop = ids

    def stop_token_ids(self) -> list[int]:
        return list(self._stop)

    def parse(self, turn_text: str, context_text: str) -> list[ToolCall]:
        nl = self.cfg.newline
        if not turn_text.endswith(nl):
            return []
        line = (context_text + turn_text[: -len(nl)]).rsplit(nl, 1)[-1]
        return [ToolCall(self.cfg.tool, {self.cfg.argument: line})]

    def render(self, results: list[ToolResult]) -> str:
        cfg = self.cfg
        return "".join(((cfg.response_template if r.ok or cfg.error_template is None else cfg.error_template)
                        .replace(_OUTPUT, r.output)) for r in results)


FORMATS: dict[str, type[ToolCallFormat]] = {"hermes": HermesFormat, "line": LineFormat}


def encode_tool_response(tok: Any, fmt: ToolCallFormat, results: list[ToolResult]) -> list[int]:
    """The ids of the rendered tool response. Normally the whole text is encoded at once. When an
    output holds special-token text (``<|im_end|>``, ``<|im_start|>``: a forged end of the tool
    message and a forged turn), the template is encoded around each output and every output is
    encoded with ``split_special_tokens``, so that what a tool printed stays text."""
    def encode(text: str, **kw: Any) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False, **kw))

    unk = getattr(tok, "unk_token_id", None)
    special = [t.content for i, t in getattr(tok, "added_tokens_decoder", {}).items() if t.special and i != unk]
    if not any(text in r.output for r in results for text in special):
        return encode(fmt.render(results))  # the usual case: one encode of the whole text
    marks = {f"@@tool-output-{k}@@": r.output for k, r in enumerate(results)}  # where each output goes
    rendered = fmt.render([replace(r, output=m) for r, m in zip(results, marks)])
    ids: list[int] = []
    for piece in re.split("(@@tool-output-[0-9]+@@)", rendered):
        if piece in marks:
            ids += encode(marks[piece], split_special_tokens=True)
        elif piece:
            ids += encode(piece)
    return ids


def hermes_system_prompt(tools: Iterable[type[Tool] | Tool], intro: str = "") -> str:
    """A system prompt listing ``tools`` for a Hermes/Qwen-style chat model (``hermes`` format)."""
    lines = [intro.rstrip(), ""] if intro else []
    lines += ["# Tools", "", "Functions you can call, as JSON signatures inside <tools></tools>:", "<tools>"]
    lines += [json.dumps(t.schema()) for t in tools]
    lines += ["</tools>", "", "To call one, write a JSON object with its name and arguments inside "
              "<tool_call></tool_call> tags:", "<tool_call>",
              '{"name": <function-name>, "arguments": <args-json-object>}', "</tool_call>"]
    return "\n".join(lines)
