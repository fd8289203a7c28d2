"""Mistral calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, any text before the marker
being content (vLLM's "mistral" parser, pre-v11 tokenizers). `[TOOL_CALLS]` is a special token, so
the reply is decoded with special tokens kept."""

from __future__ import annotations

import json
from typing import Any

from deepinfer.core.structured.tool_parsers.base import (
    CallDraft,
    FunctionTool,
    Scan,
    ToolParser,
    draft_of,
    held_prefix_len,
)
from deepinfer.core.structured.tool_parsers.json_scan import read_object, skip_whitespace

MARKER = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True
    call_separator = ", "

    def scan(self, text: str, final: bool, tools: list[FunctionTool] | None = None) -> Scan:
        start = text.find(MARKER)
        if start < 0:
            held = 0 if final else held_prefix_len(text, MARKER)
            return Scan(text[:len(text) - held], [])
        content = text[:start]
        pos = skip_whitespace(text, start + len(MARKER))
        calls: list[CallDraft] = []
        if pos >= len(text) or text[pos] != "[":
            return Scan(content, [CallDraft(None, "", False, text[start:])] if pos < len(text) else [])
        pos = skip_whitespace(text, pos + 1)
        while pos < len(text) and text[pos] == "{":
            obj = read_object(text, pos)
            if obj is None:
                calls.append(CallDraft(None, "", False, text[pos:]))
                break
            calls.append(draft_of(text, obj, pos))
            if obj.end is None:
                break
            pos = skip_whitespace(text, obj.end)
            if pos < len(text) and text[pos] == ",":
                pos = skip_whitespace(text, pos + 1)
        return Scan(content, calls)

    def _marker_token(self) -> str:
        """The marker as the grammar names the special token: `<[id]>`."""
        token_id = self.tokenizer.hf_tokenizer.convert_tokens_to_ids(MARKER) if self.tokenizer is not None else None
        if token_id is None or token_id == getattr(self.tokenizer.hf_tokenizer, "unk_token_id", None):
            return self.lark_string(MARKER)
        return f"<[{token_id}]>"

    def call_grammar(self, tools: list[FunctionTool], parallel: bool) -> str:
        rules, names = self.object_call_rules(tools, "arguments")
        calls = 'call (", " call)*' if parallel else "call"
        return f'start: {self._marker_token()} "[" {calls} "]"\ncall: {" | ".join(names)}\n{rules}\n'

    def format_call(self, name: str, arguments: dict[str, Any]) -> str:
        return MARKER + json.dumps([{"name": name, "arguments": arguments}], ensure_ascii=False)
