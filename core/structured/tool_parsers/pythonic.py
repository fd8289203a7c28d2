"""Pythonic calls (Llama 3.2 and Llama 4; vLLM's "pythonic" parser): the whole reply is a Python list
of calls with keyword arguments, `[get_weather(city="Paris", unit="celsius"), get_time(zone="UTC")]`,
optionally between Llama 4's `<|python_start|>` and `<|python_end|>`. A reply that does not open
with `[name(` is content.

Each argument value is a literal, read as JSON first (what the call grammar writes: `true`, `null`,
double-quoted strings) and as a Python literal otherwise (`True`, `'text'`, tuples); a value that is
neither makes the call invalid (its text stays content). Arguments are reported one by one as their
values complete, so the streamed arguments only grow.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from deepinfer.core.structured.tool_parsers.base import CallDraft, FunctionTool, Scan, ToolParser
from deepinfer.core.structured.tool_parsers.json_scan import skip_whitespace

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
_CALL_START = re.compile(r"\s*\[\s*[A-Za-z_][\w.\-]*\s*\(")
_MAY_START = re.compile(r"\s*(\[\s*([A-Za-z_][\w.\-]*\s*)?)?")
_CLOSERS = {")": "(", "]": "[", "}": "{"}


def _value_end(text: str, pos: int) -> int | None:
    """The index of the "," or ")" that ends the argument value starting at text[pos], or None while
    the value is unfinished (an open string or bracket, or the end of the text)."""
    depth, i = 0, pos
    while i < len(text):
        char = text[i]
        if char in "'\"":
            i += 1
            while i < len(text) and text[i] != char:
                i += 2 if text[i] == "\\" else 1
            if i >= len(text):
                return None
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            if depth == 0:
                return i if char == ")" else None
            depth -= 1
        elif char == "," and depth == 0:
            return i
        i += 1
    return None


def _literal(text: str) -> Any:
    """A value's text -> its JSON value. Raises ValueError."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(text)
        json.dumps(value)  # sets, bytes and complex numbers have no JSON form
        return value
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise ValueError(f"not a literal: {text[:40]!r}") from None


def _arguments(tool: int, keys: list[str], required: set[str]) -> str:
    """Lark for the keyword arguments `a<tool>_<k>` in schema order: the required ones, any of the others,
    joined by ", "."""
    def after(k: int) -> str:  # arguments k.. once one is written (each after ", ")
        if k == len(keys):
            return ""
        item = f'", " a{tool}_{k}'
        return (item if keys[k] in required else f"({item})?") + " " + after(k + 1)

    def first(k: int) -> str:  # arguments k.. while none is written yet
        if k == len(keys):
            return ""
        written = f"a{tool}_{k} {after(k + 1)}"
        if keys[k] in required:
            return written
        rest = first(k + 1)
        return f"({written} | {rest})" if rest else f"({written})?"

    return first(0)


class PythonicToolParser(ToolParser):
    name = "pythonic"
    call_separator = ", "

    def scan(self, text: str, final: bool, tools: list[FunctionTool] | None = None) -> Scan:
        stripped = text.lstrip()
        body_start = len(text) - len(stripped) + (len(PYTHON_START) if stripped.startswith(PYTHON_START) else 0)
        body = text[body_start:]
        if not _CALL_START.match(body):
            undecided = not final and (_MAY_START.fullmatch(body) is not None or PYTHON_START.startswith(stripped))
            return Scan("" if undecided else text, [])
        calls: list[CallDraft] = []
        pos = skip_whitespace(text, body_start) + 1  # after "["
        while True:
            pos = skip_whitespace(text, pos)
            draft, end = self._call(text, pos)
            calls.append(draft)
            if end is None:
                return Scan("", calls)
            pos = skip_whitespace(text, end)
            if pos < len(text) and text[pos] == ",":
                pos += 1
                continue
            if pos < len(text) and text[pos] == "]":
                rest = text[pos + 1:].strip().removesuffix(PYTHON_END).strip()
                return Scan(rest, calls)
            if pos < len(text):  # neither another call nor the list's end: not a call list after all
                calls[-1] = CallDraft(None, "", False, text[body_start:])
                return Scan("", calls[-1:] if len(calls) == 1 else calls)
            return Scan("", calls)

    @staticmethod
    def _call(text: str, pos: int) -> tuple[CallDraft, int | None]:
        """The call at text[pos] -> (its draft, the index after its ")" or None while unfinished or invalid)."""
        name = _NAME.match(text, pos)
        open_paren = skip_whitespace(text, name.end()) if name else pos
        if name is None or open_paren >= len(text) or text[open_paren] != "(":
            return CallDraft(None, "", False, text[pos:]), None
        entries, i = [], open_paren + 1
        while True:
            i = skip_whitespace(text, i)
            if i >= len(text):
                break
            if text[i] == ")":
                arguments = "{" + ", ".join(entries) + "}"
                return CallDraft(name.group(), arguments, True, text[pos:i + 1]), i + 1
            key = _NAME.match(text, i)
            equals = skip_whitespace(text, key.end()) if key else i
            if key is None or equals >= len(text) or text[equals] != "=":
                if key is None or equals < len(text):
                    return CallDraft(None, "", False, text[pos:]), None  # not keyword arguments
                break
            end = _value_end(text, equals + 1)
            if end is None:
                break
            try:
                value = _literal(text[equals + 1:end].strip())
            except ValueError:
                return CallDraft(None, "", False, text[pos:]), None
            entries.append(f"{json.dumps(key.group())}: {json.dumps(value, ensure_ascii=False)}")
            i = end + 1 if text[end] == "," else end
        return CallDraft(name.group(), "{" + ", ".join(entries), False, text[pos:]), None

    def call_grammar(self, tools: list[FunctionTool], parallel: bool) -> str:
        rules, names = [], []
        for i, tool in enumerate(tools):
            properties = list(tool.parameters.get("properties", {}).items())
            required = set(tool.parameters.get("required", []))
            for k, (key, schema) in enumerate(properties):
                value = self.arguments_schema(FunctionTool(key, None, schema if isinstance(schema, dict) else {}))
                rules.append(f"a{i}_{k}: {self.lark_string(key + '=')} v{i}_{k}\nv{i}_{k}: %json {value}")

            keys = [key for key, _ in properties]
            rules.append(f"c{i}: {self.lark_string(tool.name + '(')} {_arguments(i, keys, required)} \")\"")
            names.append(f"c{i}")
        calls = 'call (", " call)*' if parallel else "call"
        return f'start: "[" {calls} "]"\ncall: {" | ".join(names)}\n' + "\n".join(rules) + "\n"

    def format_call(self, name: str, arguments: dict[str, Any]) -> str:
        listed = ", ".join(f"{key}={json.dumps(value, ensure_ascii=False)}" for key, value in arguments.items())
        return f"[{name}({listed})]"
