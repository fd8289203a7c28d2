"""Tool-call parsers, one per model family's format, chosen by name (`--tool-call-parser`) or
detected from the chat template (`detect_tool_parser`)."""

from __future__ import annotations

from deepinfer.core.structured.tool_parsers.base import (
    CallDraft,
    FunctionTool,
    Scan,
    ToolCall,
    ToolCallStream,
    ToolParser,
)
from deepinfer.core.structured.tool_parsers.hermes import HermesToolParser
from deepinfer.core.structured.tool_parsers.llama3_json import Llama3JsonToolParser
from deepinfer.core.structured.tool_parsers.mistral import MistralToolParser
from deepinfer.core.structured.tool_parsers.pythonic import PythonicToolParser
from deepinfer.core.structured.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                                        Qwen3CoderToolParser, PythonicToolParser)
}


def detect_tool_parser(chat_template: str | None) -> str:
    """The parser whose format the template writes tool calls in. A template without tool support
    gets "hermes", the format deepinfer then describes to the model itself (tools.py)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "[func_name1(" in template:
        return "pythonic"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("ipython" in template and "<|start_header_id|>" in template):
        return "llama3_json"
    return "hermes"


def make_tool_parser(name: str | None, tokenizer) -> ToolParser:
    """The parser `name` (None: detected from the tokenizer's chat template). Raises ValueError."""
    if name is None:
        name = detect_tool_parser(getattr(getattr(tokenizer, "hf_tokenizer", None), "chat_template", None))
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; use one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name](tokenizer)


__all__ = ["TOOL_PARSERS", "CallDraft", "FunctionTool", "Scan", "ToolCall", "ToolCallStream", "ToolParser",
           "detect_tool_parser", "make_tool_parser"]
