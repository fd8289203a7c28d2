"""Hermes / Qwen2.5 / Qwen3 calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one
block per call, any text before them being the reply's content (vLLM's "hermes" parser)."""

from __future__ import annotations

import json
from typing import Any

from deepinfer.core.structured.tool_parsers.base import (
    CallDraft,
    FunctionTool,
    Scan,
    ToolParser,
    draft_of,
    scan_tagged_calls,
)
from deepinfer.core.structured.tool_parsers.json_scan import read_object, skip_whitespace

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool, tools: list[FunctionTool] | None = None) -> Scan:
        return scan_tagged_calls(text, OPEN, CLOSE, final, lambda start, body_end, block_end, closed: self._draft(
            text[:body_end], start, text[start:block_end], closed or final))

    @staticmethod
    def _draft(text: str, start: int, raw: str, closed: bool) -> CallDraft:
        obj_start = skip_whitespace(text, start + len(OPEN))
        obj = read_object(text, obj_start) if obj_start < len(text) and text[obj_start] == "{" else None
        if obj is None:
            return CallDraft(None, "", False, raw)
        draft = draft_of(text, obj, start)
        draft.complete = draft.complete and closed
        draft.raw = raw
        return draft

    def call_grammar(self, tools: list[FunctionTool], parallel: bool) -> str:
        rules, names = self.object_call_rules(tools, "arguments")
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return f'{start}\ncall: "<tool_call>\\n" ({" | ".join(names)}) "\\n</tool_call>"\n{rules}\n'

    def format_call(self, name: str, arguments: dict[str, Any]) -> str:
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{OPEN}\n{body}\n{CLOSE}"
