"""Qwen3-Coder's XML calls (vLLM's "qwen3_coder" parser):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

one block per call, any text before them being content. A parameter's value is raw text, read by
the type the tool's schema gives it: a string stays text, a boolean may be Python's `True`,
anything else is read as JSON (text that is not JSON stays a string), so the arguments become one JSON object. A parameter is
reported once its closing tag is there; the object closes with `</function>`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from deepinfer.core.structured.tool_parsers.base import (
    CallDraft,
    FunctionTool,
    Scan,
    ToolParser,
    scan_tagged_calls,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER = re.compile(r"<parameter=([^>\n]+)>")
PARAMETER_CLOSE = "</parameter>"
# A string value as the call grammar lets it be written: lines that do not start with "<", then the closing
# tag (one lexeme, so the value's end is never ambiguous).
STRING_VALUE = r"([^\n]|\n+[^<\n])*\n<\/parameter>"


def _string_lexeme(schema: dict[str, Any]) -> str:
    """The regex of a string parameter's text and closing tag, with the schema's pattern or length."""
    if "pattern" in schema:
        text = schema["pattern"].removeprefix("^").removesuffix("$").replace("/", "\\/")
    elif "maxLength" in schema or "minLength" in schema:
        text = f"[^\\n<]{{{int(schema.get('minLength', 0))},{int(schema.get('maxLength', 1 << 16))}}}"
    else:
        return STRING_VALUE
    return f"({text})\\n<\\/parameter>"


def _value(raw: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's text -> its JSON value, by its schema's type."""
    text = raw.removeprefix("\n").removesuffix("\n")
    kind = (schema or {}).get("type", "string")
    if kind == "string" or schema is None:
        return text
    if kind == "boolean" and text.lower() in ("true", "false"):  # the template writes Python's True
        return text.lower() == "true"
    try:
        return json.loads(text)
    except ValueError:
        return text


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def scan(self, text: str, final: bool, tools: list[FunctionTool] | None = None) -> Scan:
        schemas = {tool.name: tool.parameters.get("properties", {}) for tool in tools or []}
        return scan_tagged_calls(text, OPEN, CLOSE, final, lambda start, body_end, block_end, closed: self._draft(
            text[start:block_end], closed, schemas))

    @staticmethod
    def _draft(block: str, closed: bool, schemas: dict[str, dict]) -> CallDraft:
        head = block.find(FUNCTION_OPEN)
        name_end = block.find(">", head) if head >= 0 else -1
        if head < 0 or name_end < 0 or block[len(OPEN):head].strip():
            return CallDraft(None, "", False, block)
        name = block[head + len(FUNCTION_OPEN):name_end]
        properties = schemas.get(name)
        entries, pos = [], name_end + 1
        while True:
            found = PARAMETER.search(block, pos)
            if found is None:
                break
            value_end = block.find(PARAMETER_CLOSE, found.end())
            if value_end < 0:
                break
            key = found.group(1)
            schema = properties.get(key) if properties is not None else None
            entries.append(f"{json.dumps(key, ensure_ascii=False)}: "
                           f"{json.dumps(_value(block[found.end():value_end], schema), ensure_ascii=False)}")
            pos = value_end + len(PARAMETER_CLOSE)
        function_closed = block.find(FUNCTION_CLOSE, pos) >= 0
        arguments = "{" + ", ".join(entries) + ("}" if function_closed else "")
        return CallDraft(name, arguments, function_closed and closed, block)

    def call_grammar(self, tools: list[FunctionTool], parallel: bool) -> str:
        rules, names = [], []
        for i, tool in enumerate(tools):
            params = []
            required = set(tool.parameters.get("required", []))
            for j, (key, schema) in enumerate(tool.parameters.get("properties", {}).items()):
                head = self.lark_string(f"<parameter={key}>\n")
                if isinstance(schema, dict) and schema.get("type", "string") == "string" and "enum" not in schema:
                    rules.append(f"v{i}_{j}: V{i}_{j}\nV{i}_{j}: /{_string_lexeme(schema)}/")
                    item = f"{head} v{i}_{j} \"\\n\""
                elif isinstance(schema, dict) and "enum" in schema and all(isinstance(e, str) for e in schema["enum"]):
                    choices = " | ".join(self.lark_string(e) for e in schema["enum"])
                    item = f"{head} ({choices}) {self.lark_string(chr(10) + PARAMETER_CLOSE + chr(10))}"
                else:
                    value = self.arguments_schema(FunctionTool(key, None, schema if isinstance(schema, dict) else {}))
                    rules.append(f"v{i}_{j}: %json {value}")
                    item = f"{head} v{i}_{j} {self.lark_string(chr(10) + PARAMETER_CLOSE + chr(10))}"
                params.append(item if key in required else f"({item})?")
            body = " ".join(params)
            rules.append(f"c{i}: {self.lark_string(f'<function={tool.name}>' + chr(10))} {body} "
                         f"{self.lark_string(FUNCTION_CLOSE)}")
            names.append(f"c{i}")
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return f'{start}\ncall: "<tool_call>\\n" ({" | ".join(names)}) "\\n</tool_call>"\n' + "\n".join(rules) + "\n"

    def format_call(self, name: str, arguments: dict[str, Any]) -> str:
        params = "".join(f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n"
                         f"{PARAMETER_CLOSE}\n" for key, value in arguments.items())
        return f"{OPEN}\n{FUNCTION_OPEN}{name}>\n{params}{FUNCTION_CLOSE}\n{CLOSE}"
