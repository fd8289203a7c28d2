"""Anthropic's Messages API request bodies, and their translation into a chat completion request.

Fields follow https://docs.anthropic.com/en/api/messages. Text, tool_use and tool_result blocks
translate into OpenAI chat messages (an assistant turn's tool_use blocks into its `tool_calls`,
each tool_result into a `tool` turn), `tools` with `input_schema` into function tools, and
`tool_choice` auto / any / tool / none into auto / required / a named function / none; the chat
path then renders, constrains and parses them as it does its own; `output_config.format` (a JSON
Schema) is its structured output; `thinking` switches the template's `enable_thinking` and its
`budget_tokens` is the chat path's `thinking_token_budget`. Earlier `thinking` blocks are
dropped, as chat templates drop earlier reasoning. `cache_control` is ignored (the prefix cache
needs no marks) and so is `metadata`. Images, documents and Anthropic's server tools (web search,
code execution, ...) are a 400.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deepinfer.core.server.errors import InvalidParameter, validation_message
from deepinfer.core.server.protocol import ChatCompletionRequest, Int, StopStrings

_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class TextBlock(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = _STRICT
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = _STRICT
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] = ""
    is_error: bool = False


class Message(BaseModel):
    model_config = _STRICT
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class Thinking(BaseModel):
    """`{"type": "enabled", "budget_tokens": N}`, `{"type": "disabled"}`, or "adaptive" / "between_tools"
    (the model decides; here: enabled)."""

    model_config = _STRICT
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Int | None = Field(None, ge=1)


class OutputFormat(BaseModel):
    model_config = _STRICT
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """`output_config`: a JSON Schema the answer must follow (structured outputs), and an effort."""

    model_config = _STRICT
    format: OutputFormat | None = None
    effort: str | None = None


class _Conversation(BaseModel):
    """What a message and a token count share."""

    model_config = _STRICT
    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: Thinking | None = None

    def chat_fields(self) -> dict[str, Any]:
        """The ChatCompletionRequest fields of the conversation: messages, tools, tool_choice."""
        messages = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            messages.append({"role": "system", "content": system})
        if not self.messages:
            raise InvalidParameter("messages: at least one message is required", param="messages")
        for index, message in enumerate(self.messages):
            messages += _chat_messages(message, f"messages.{index}")
        fields: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.tools:
            fields["tools"] = [_function_tool(tool, f"tools.{index}") for index, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            fields["tool_choice"], parallel = _tool_choice(self.tool_choice)
            if parallel is not None:
                fields["parallel_tool_calls"] = parallel
        if self.thinking is not None:
            # What the chat path's templates read (Qwen3's enable_thinking); a template without it ignores it.
            fields["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
        return fields

    def chat_request(self, **sampling: Any) -> ChatCompletionRequest:
        return _validated(ChatCompletionRequest, {**self.chat_fields(), **sampling}, "request")


class MessagesRequest(_Conversation):
    max_tokens: Int = Field(ge=1)
    stop_sequences: StopStrings | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)  # Anthropic's range
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int | None = Field(None, ge=1)
    metadata: dict[str, Any] | None = None  # accepted, ignored
    output_config: OutputConfig | None = None

    def to_chat_request(self) -> ChatCompletionRequest:
        thinking = self.thinking
        budget = thinking.budget_tokens if thinking is not None and thinking.type != "disabled" else None
        if budget is not None and budget >= self.max_tokens:
            # The reasoning counts against max_tokens, as Anthropic's does: its budget must leave room for the answer.
            raise InvalidParameter(f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                                   f"({self.max_tokens})", param="thinking.budget_tokens")
        sampling = {"max_tokens": self.max_tokens, "stop": self.stop_sequences, "stream": self.stream,
                    "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                    "thinking_token_budget": budget}  # the chat path caps the reasoning at the budget
        if self.stream:
            sampling["stream_options"] = {"include_usage": True}  # message_delta reports the output tokens
        output = self.output_config
        if output is not None and output.format is not None:
            sampling["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": "output", "schema": output.format.schema_}}
        if output is not None and output.effort is not None:
            sampling["reasoning_effort"] = output.effort  # what the chat path's templates read
        return self.chat_request(**{k: v for k, v in sampling.items() if v is not None})


class CountTokensRequest(_Conversation):
    """POST /v1/messages/count_tokens: the conversation without the sampling fields."""


def _validated(model: type[BaseModel], payload: dict, where: str):
    try:
        return model.model_validate(payload)
    except ValidationError as err:
        message, param = validation_message(err.errors())
        param = f"{where}.{param}" if param else where
        raise InvalidParameter(f"{where}: {message}", param=param) from None


def _text_of(blocks: str | list[dict[str, Any]], where: str) -> str:
    """A tool_result's content: a string or text blocks."""
    if isinstance(blocks, str):
        return blocks
    return "".join(_validated(TextBlock, block, f"{where}.{index}").text for index, block in enumerate(blocks))


def _chat_messages(message: Message, where: str) -> list[dict[str, Any]]:
    """One Anthropic turn -> chat messages: a user turn's tool_result blocks become `tool` turns
    (in their place among its text), an assistant turn's tool_use blocks its `tool_calls`."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    chat: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for index, block in enumerate(message.content):
        at = f"{where}.content.{index}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_validated(TextBlock, block, at).text)
        elif kind in ("thinking", "redacted_thinking") and message.role == "assistant":
            continue  # earlier reasoning: chat templates drop it
        elif kind == "tool_use" and message.role == "assistant":
            use = _validated(ToolUseBlock, block, at)
            calls.append({"id": use.id, "type": "function",
                          "function": {"name": use.name, "arguments": json.dumps(use.input, ensure_ascii=False)}})
        elif kind == "tool_result" and message.role == "user":
            result = _validated(ToolResultBlock, block, at)
            if texts:
                chat.append({"role": "user", "content": "".join(texts)})
                texts = []
            chat.append({"role": "tool", "tool_call_id": result.tool_use_id,
                         "content": _text_of(result.content, f"{at}.content")})
        else:
            allowed = "text, thinking, tool_use" if message.role == "assistant" else "text, tool_result"
            raise InvalidParameter(f"{at}: content blocks of type {kind!r} are not supported in {message.role} "
                                   f"turns (supported: {allowed})", param=at)
    if message.role == "assistant":
        entry: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
        return [entry | ({"tool_calls": calls} if calls else {})]
    if texts or not chat:
        chat.append({"role": "user", "content": "".join(texts)})
    return chat


def _function_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    """An Anthropic custom tool ({name, description, input_schema}) -> an OpenAI function tool."""
    if not isinstance(tool, dict):
        raise InvalidParameter(f"{where}: a tool is an object", param=where)
    if tool.get("type", "custom") != "custom":
        raise InvalidParameter(f"{where}: Anthropic's server tool {tool['type']!r} is not supported; send custom "
                               f"tools (name, description, input_schema)", param=where)
    if not isinstance(tool.get("input_schema"), dict):
        raise InvalidParameter(f"{where}.input_schema: a JSON Schema object is required", param=f"{where}.input_schema")
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict[str, Any]) -> tuple[str | dict[str, Any], bool | None]:
    """Anthropic's tool_choice -> (the chat tool_choice, parallel_tool_calls or None)."""
    kind = choice.get("type")
    disable_parallel = choice.get("disable_parallel_tool_use")
    if disable_parallel is not None and not isinstance(disable_parallel, bool):
        raise InvalidParameter("tool_choice.disable_parallel_tool_use must be a boolean",
                               param="tool_choice.disable_parallel_tool_use")
    parallel = None if disable_parallel is None else not disable_parallel
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise InvalidParameter("tool_choice of type 'tool' needs the tool's name", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise InvalidParameter(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", param="tool_choice.type")


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every non-200 answer of the Messages API's routes: Anthropic's error shape."""

    type: Literal["error"]
    error: AnthropicErrorDetail
