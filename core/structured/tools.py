"""Tool calling for one chat request: the tools in the prompt, tool_choice as a grammar, the parser.

- The tools go to the model's own chat template (transformers' `tools=`); assistant turns with
  `tool_calls` get their arguments as objects and `tool` turns keep their `tool_call_id`, as the
  templates of Qwen2.5, Llama 3.1 and Mistral expect (vLLM does the same).
- A template that knows nothing of tools (no "tools" in it) would drop them silently; deepinfer
  then describes the tools in a system message in the parser's format (`ToolParser.tool_prompt`),
  writes earlier calls into the assistant text in that format and passes tool results as user
  turns wrapped in <tool_response> tags, as Qwen2.5's template does.
- tool_choice: "none" shows no tools and parses nothing; "auto" lets the model choose and parses
  what it writes; "required" and a named function constrain the reply with the parser's grammar
  (`ToolPlan.constraint`), so it is one or more well-formed calls whose arguments validate
  against the function's `parameters` (a named function: exactly one call of it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from deepinfer.core.structured.params import StructuredOutputsParams
from deepinfer.core.structured.tool_parsers import FunctionTool, ToolParser

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MAX_TOOLS = 128


def parse_tools(tools: list[dict[str, Any]] | None) -> list[FunctionTool]:
    """OpenAI's `tools` -> FunctionTools. Raises ValueError or TypeError naming the bad entry."""
    parsed: list[FunctionTool] = []
    if len(tools or []) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools are accepted, got {len(tools)}")
    for index, tool in enumerate(tools or []):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"{where}: only tools of type 'function' are supported")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise TypeError(f"{where}.function must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ValueError(f"{where}.function.name must be 1 to 64 letters, digits, '_', '.' or '-'")
        if any(t.name == name for t in parsed):
            raise ValueError(f"{where}: the function name {name!r} is used twice")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"{where}.function.description must be a string")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise TypeError(f"{where}.function.parameters must be a JSON Schema object")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ValueError(f"{where}.function.strict must be a boolean")
        parsed.append(FunctionTool(name, description, parameters, strict))
    return parsed


@dataclass
class ToolPlan:
    """What a request asks of tools, checked."""

    tools: list[FunctionTool]  # shown to the model (none for tool_choice "none")
    choice: str  # "none", "auto", "required" or "named"
    function: str | None  # the named function
    parallel: bool
    parser: ToolParser

    @classmethod
    def make(cls, tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None,
             parser: ToolParser) -> ToolPlan:
        """Raises ValueError (or TypeError) for a bad tools list or a tool_choice that does not fit it."""
        functions = parse_tools(tools)
        choice, name = _tool_choice(tool_choice, functions)
        if choice == "none":
            functions = []
        return cls(functions, choice, name, True if parallel_tool_calls is None else parallel_tool_calls, parser)

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none" and bool(self.tools)

    @property
    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar of the calls the reply must be, for "required" and a named function."""
        if self.choice == "required":
            return StructuredOutputsParams(grammar=self.parser.call_grammar(self.tools, self.parallel))
        if self.choice == "named":
            named = [tool for tool in self.tools if tool.name == self.function]
            return StructuredOutputsParams(grammar=self.parser.call_grammar(named, parallel=False))
        return None


def _tool_choice(tool_choice: Any, functions: list[FunctionTool]) -> tuple[str, str | None]:
    if tool_choice is None:
        return ("auto" if functions else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a named function, "
                             f"got {tool_choice!r}")
        if tool_choice == "required" and not functions:
            raise ValueError("tool_choice 'required' needs at least one tool")
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
        raise ValueError('a named tool_choice is {"type": "function", "function": {"name": "..."}}')
    if not any(tool.name == name for tool in functions):
        raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
    return "named", name


def template_supports_tools(tokenizer) -> bool:
    template = getattr(getattr(tokenizer, "hf_tokenizer", None), "chat_template", None)
    return isinstance(template, str) and "tools" in template


def template_messages(messages: list[dict[str, Any]], parser: ToolParser, plan: ToolPlan | None,
                      supports_tools: bool) -> list[dict[str, Any]]:
    """Plain chat messages (role, content, and tool_calls / tool_call_id where given) -> what the
    template receives: calls' arguments as objects; for a template without tools, the fallback of
    the module docstring."""
    prepared = [_with_argument_objects(m) for m in messages]
    if supports_tools:
        return prepared
    rendered = []
    for message in prepared:
        if message.get("tool_calls"):
            calls = [parser.format_call(c["function"]["name"], c["function"]["arguments"])
                     for c in message["tool_calls"]]
            text = parser.call_separator.join(calls)
            content = message.get("content") or ""
            rendered.append({"role": "assistant", "content": f"{content}\n{text}" if content else text})
        elif message["role"] == "tool":
            rendered.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        else:
            rendered.append({"role": message["role"], "content": message.get("content") or ""})
    if plan is not None and plan.tools:
        prompt = parser.tool_prompt(plan.tools)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": f"{rendered[0]['content']}\n\n{prompt}"}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for call in calls:
        function = dict(call["function"])
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise ValueError(f"the arguments of the earlier call to {function.get('name')!r} "
                                 f"are not valid JSON") from None
        converted.append({**call, "function": function})
    return {**message, "tool_calls": converted}


def render_chat(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool, parser: ToolParser,
                plan: ToolPlan | None = None, template_variables: dict[str, Any] | None = None) -> str:
    """The prompt text of a conversation with tools. Raises InvalidRequestError (template) or ValueError."""
    supports_tools = template_supports_tools(tokenizer)
    prepared = template_messages(messages, parser, plan, supports_tools)
    tools = [tool.as_openai() for tool in plan.tools] if plan is not None and plan.tools and supports_tools else None
    return tokenizer.apply_chat_template(prepared, add_generation_prompt=add_generation_prompt, tools=tools,
                                         template_variables=template_variables)
