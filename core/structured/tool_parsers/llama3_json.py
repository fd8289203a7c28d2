"""Llama 3.1 / 3.2 / 3.3 JSON calls: the whole reply is `{"name": ..., "parameters": {...}}`, several
joined by "; ", optionally after `<|python_tag|>` (vLLM's "llama3_json" parser). A reply that does
not open with `{"name"` is content."""

from __future__ import annotations

import json
import re
from typing import Any

from deepinfer.core.structured.tool_parsers.base import CallDraft, FunctionTool, Scan, ToolParser, draft_of
from deepinfer.core.structured.tool_parsers.json_scan import read_object, skip_whitespace

PYTHON_TAG = "<|python_tag|>"
_CALL_START = re.compile(r'\s*\{\s*"name"\s*:')
_CALL_START_TEXT = '{"name":'


def _may_become_call(body: str) -> bool:
    """Whether the reply so far may still grow into a call's start (held back until it is decided)."""
    return _CALL_START_TEXT.startswith("".join(body.split()))


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    call_separator = "; "

    def scan(self, text: str, final: bool, tools: list[FunctionTool] | None = None) -> Scan:
        body = text.removeprefix(PYTHON_TAG)
        offset = len(text) - len(body)
        if not _CALL_START.match(body):
            undecided = not final and (_may_become_call(body) or PYTHON_TAG.startswith(text))
            return Scan("" if undecided else text, [])
        calls: list[CallDraft] = []
        pos = skip_whitespace(text, offset)
        while pos < len(text) and text[pos] == "{":
            obj = read_object(text, pos)
            if obj is None:
                calls.append(CallDraft(None, "", False, text[pos:]))
                return Scan("", calls)
            calls.append(draft_of(text, obj, pos))
            if obj.end is None:
                return Scan("", calls)
            pos = skip_whitespace(text, obj.end)
            if pos < len(text) and text[pos] == ";":
                pos = skip_whitespace(text, pos + 1)
        rest = text[pos:]
        return Scan(rest if rest.strip() else "", calls)

    def call_grammar(self, tools: list[FunctionTool], parallel: bool) -> str:
        rules, names = self.object_call_rules(tools, "parameters")
        start = 'start: call ("; " call)*' if parallel else "start: call"
        return f'{start}\ncall: {" | ".join(names)}\n{rules}\n'

    def format_call(self, name: str, arguments: dict[str, Any]) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
