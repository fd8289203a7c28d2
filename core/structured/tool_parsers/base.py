"""What every tool-call format shares: the tools, a scan of the reply text, streaming deltas, grammars.

A parser reads one model family's way of writing calls. Its `scan(text, final)` splits the reply
written so far into the content a user may see now and the calls being written (`CallDraft`:
name once complete, arguments as raw JSON text so far). Scans are prefix-stable: as the text
grows, the content and each call's arguments only grow, so `ToolCallStream` can send OpenAI's
deltas by difference (a call's id and name first, then argument fragments) and their
concatenation equals what the non-streaming answer (`extract`) returns.

`call_grammar` writes the format as an llguidance Lark grammar whose arguments are each tool's
`parameters` schema (`%json`), for tool_choice "required" or a named function: the model can then
only write well-formed calls whose arguments validate.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deepinfer.core.structured.tool_parsers.json_scan import PartialObject

# The JSON writing options of deepinfer.core.structured.compiler.JSON_OPTIONS, in a schema's own
# "x-guidance" (what llguidance's %json reads).
CALL_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class FunctionTool:
    """One `{"type": "function", "function": {...}}` entry of a request's tools."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None

    def as_openai(self) -> dict[str, Any]:
        """The tool as chat templates take it (transformers' `tools=` format)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass
class CallDraft:
    name: str | None  # None until the name is completely written
    arguments: str  # raw JSON text of the arguments so far ("" before they start)
    complete: bool  # the call's text is finished
    raw: str = ""  # the call's whole text, given back as content when it is not a valid call


@dataclass
class Scan:
    content: str  # text outside calls that can be shown now
    calls: list[CallDraft]


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: new_tool_call_id())

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def draft_of(text: str, obj: PartialObject, start: int) -> CallDraft:
    """A call written as `{"name": ..., "arguments": {...}}` (or "parameters"), from text[start]."""
    arguments, complete_args = "", False
    for key in ARGUMENT_KEYS:
        found = obj.raw(text, key)
        if found is not None:
            arguments, complete_args = found
            break
    complete = obj.end is not None
    return CallDraft(obj.string(text, "name"), arguments, complete and complete_args,
                     text[start:obj.end if complete else len(text)])


def is_valid_call(draft: CallDraft) -> bool:
    if not draft.complete or draft.name is None:
        return False
    try:
        return isinstance(json.loads(draft.arguments), dict)
    except ValueError:
        return False


def held_prefix_len(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that could be the start of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


def scan_tagged_calls(text: str, open_tag: str, close_tag: str, final: bool,
                      draft: Callable[[int, int, int, bool], CallDraft]) -> Scan:
    """The reply as content around `open_tag ... close_tag` blocks, one call each (Hermes, Qwen3-Coder).

    `draft(start, body_end, block_end, closed)` makes a block's call: `start` where its open tag is,
    `body_end` where its close tag is (the text's end while unclosed), `block_end` past the close tag.
    Whitespace between or after calls is not content (kept back while streaming, dropped at the end),
    and while streaming a tail that could be the start of the open tag is held back.
    """
    content: list[str] = []
    calls: list[CallDraft] = []
    pos = 0
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            tail = text[pos:]
            if not final:
                tail = tail[:len(tail) - held_prefix_len(tail, open_tag)]
            content.append("" if calls and not tail.strip() else tail)
            break
        between = text[pos:start]
        content.append("" if calls and not between.strip() else between)
        close = text.find(close_tag, start)
        body_end = close if close >= 0 else len(text)
        block_end = close + len(close_tag) if close >= 0 else len(text)
        calls.append(draft(start, body_end, block_end, close >= 0))
        if close < 0:
            break
        pos = block_end
    return Scan("".join(content), calls)


class ToolParser:
    name = ""
    needs_special_tokens = False  # the format's markers are special tokens the text must keep
    call_separator = "\n"  # between calls in `format_calls`

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer

    def scan(self, text: str, final: bool, tools: list[FunctionTool] | None = None) -> Scan:
        """`tools`: the request's, for formats whose argument values are typed by the schema."""
        raise NotImplementedError

    def call_grammar(self, tools: list[FunctionTool], parallel: bool) -> str:
        """Lark grammar: one call (or, with `parallel`, one or more) to one of `tools`."""
        raise NotImplementedError

    def format_call(self, name: str, arguments: dict[str, Any]) -> str:
        """The text the model writes for one call (assistant turns of templates without tools)."""
        raise NotImplementedError

    def tool_prompt(self, tools: list[FunctionTool]) -> str:
        """A system message that describes the tools and this format, for templates without tools."""
        listing = "\n".join(json.dumps(tool.as_openai(), ensure_ascii=False) for tool in tools)
        example = self.format_call("<function-name>", {"<argument-name>": "<value>"})
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n"
                f"</tools>\n\nTo call a function, reply with exactly this, one per call:\n{example}")

    def extract(self, text: str, parallel: bool = True,
                tools: list[FunctionTool] | None = None) -> tuple[str | None, list[ToolCall]]:
        """The finished reply -> (content or None, valid calls). A call that is cut off or whose
        arguments are not a JSON object stays in the content, as the model wrote it."""
        scan = self.scan(text, final=True, tools=tools)
        calls, content = [], scan.content
        for draft in scan.calls:
            if is_valid_call(draft) and (parallel or not calls):
                calls.append(ToolCall(draft.name, draft.arguments))
            else:
                content += draft.raw
        if calls and not content.strip():
            content = None
        return content, calls

    # Grammar pieces shared by the formats.
    @staticmethod
    def lark_string(literal: str) -> str:
        return json.dumps(literal, ensure_ascii=False)

    @staticmethod
    def arguments_schema(tool: FunctionTool) -> str:
        """The tool's parameters as a %json body, with the JSON writing options (and `strict`)."""
        schema = dict(tool.parameters)
        if "type" not in schema and not any(k in schema for k in ("anyOf", "oneOf", "allOf", "$ref", "enum")):
            schema["type"] = "object"
        schema["x-guidance"] = {**CALL_JSON_OPTIONS, "lenient": tool.strict is not True}
        return json.dumps(schema, ensure_ascii=False)

    def object_call_rules(self, tools: list[FunctionTool], arguments_key: str) -> tuple[str, list[str]]:
        """Rules `c<i>` for `{"name": "<tool i>", "<arguments_key>": <its parameters>}` -> (rules, names)."""
        rules, names = [], []
        for i, tool in enumerate(tools):
            head = self.lark_string(f'{{"name": "{tool.name}", "{arguments_key}": ')
            rules.append(f'c{i}: {head} a{i} "}}"\na{i}: %json {self.arguments_schema(tool)}')
            names.append(f"c{i}")
        return "\n".join(rules), names


class ToolCallStream:
    """One choice's tool-call deltas while it streams (OpenAI's chat.completion.chunk format)."""

    def __init__(self, parser: ToolParser, parallel: bool = True, tools: list[FunctionTool] | None = None) -> None:
        self.parser = parser
        self.parallel = parallel
        self.tools = tools
        self._sent_content = 0
        self._ids: list[str] = []  # one per call announced
        self._sent_arguments: list[int] = []
        self._text = ""

    @property
    def num_calls(self) -> int:
        return len(self._ids)

    def feed(self, delta_text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """The choice's new text -> (content delta, tool_calls delta entries)."""
        self._text += delta_text
        scan = self.parser.scan(self._text, final, self.tools)
        content = scan.content
        drafts = scan.calls if self.parallel else scan.calls[:1]
        if final:  # what `extract` gives back as content: calls that did not come out whole
            content += "".join(d.raw for d in drafts[len(self._ids):] if not is_valid_call(d))
        content_delta = content[self._sent_content:]
        self._sent_content = max(self._sent_content, len(content))
        deltas = []
        for index, draft in enumerate(drafts):
            if index == len(self._ids):
                if draft.name is None or (final and not is_valid_call(draft)):
                    break
                self._ids.append(new_tool_call_id())
                self._sent_arguments.append(0)
                deltas.append({"index": index, "id": self._ids[index], "type": "function",
                               "function": {"name": draft.name, "arguments": ""}})
            fragment = draft.arguments[self._sent_arguments[index]:]
            if fragment:
                self._sent_arguments[index] = len(draft.arguments)
                deltas.append({"index": index, "function": {"arguments": fragment}})
        return content_delta, deltas
