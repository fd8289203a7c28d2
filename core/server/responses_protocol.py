"""OpenAI's Responses API request body (stateless), and its translation into a chat completion request.

Fields follow https://platform.openai.com/docs/api-reference/responses/create. `input` is a string
(one user turn) or items: messages (input_text / output_text parts), function_call and
function_call_output items, which become chat messages, an assistant turn's `tool_calls` and `tool`
turns; `instructions` is the system message ahead of them. Function tools, tool_choice,
parallel_tool_calls, max_output_tokens, temperature, top_p and `text.format` (json_object,
json_schema) map onto the chat request's fields; earlier `reasoning` items are dropped, as chat
templates drop earlier reasoning.

Nothing is stored (vLLM does the same without its response store): `store: true`, the API's
default, is accepted and the response says `"store": false`; what needs stored state
(`previous_response_id`, `conversation`, item references, `background`) is a 400.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deepinfer.core.server.errors import InvalidParameter
from deepinfer.core.server.preprocess import validate
from deepinfer.core.server.protocol import ChatCompletionRequest, Int

_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
_STATEFUL = {"previous_response_id": "previous_response_id needs a stored response",
             "conversation": "conversation needs a stored conversation",
             "background": "background needs stored responses"}


class ResponsesRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True  # accepted; nothing is stored
    user: str | None = None
    metadata: dict[str, Any] | None = None  # accepted, ignored
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    truncation: str | None = None
    # Refused unless they ask for nothing: features the chat path lacks
    top_logprobs: Int | None = None
    max_tool_calls: Int | None = None
    prompt: dict[str, Any] | None = None  # a stored prompt template

    def check(self) -> None:
        for field, reason in _STATEFUL.items():
            if getattr(self, field) not in (None, False):
                raise InvalidParameter(f"{field} is not supported: this server keeps no state ({reason}); send "
                                       f"the whole conversation in input", param=field)
        for field, feature in (("top_logprobs", "log-probabilities"), ("max_tool_calls", "a cap on tool calls"),
                               ("prompt", "stored prompt templates")):
            if getattr(self, field) not in (None, 0):
                raise InvalidParameter(f"{field} is not supported by this server ({feature})", param=field)
        if self.truncation not in (None, "disabled"):
            raise InvalidParameter("truncation other than 'disabled' is not supported", param="truncation")

    def to_chat_request(self) -> ChatCompletionRequest:
        self.check()
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            for index, item in enumerate(self.input):
                _add_item(messages, item, f"input.{index}")
        fields: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream,
                                  "max_tokens": self.max_output_tokens, "temperature": self.temperature,
                                  "top_p": self.top_p, "user": self.user,
                                  "parallel_tool_calls": self.parallel_tool_calls}
        if self.tools:
            fields["tools"] = [_function_tool(tool, f"tools.{index}") for index, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            fields["tool_choice"] = _tool_choice(self.tool_choice)
        response_format = _response_format((self.text or {}).get("format"))
        if response_format is not None:
            fields["response_format"] = response_format
        if self.reasoning is not None and self.reasoning.get("effort") is not None:
            fields["reasoning_effort"] = self.reasoning["effort"]  # what the chat path's templates read
        if self.stream:
            fields["stream_options"] = {"include_usage": True}  # response.completed reports the usage
        return validate({k: v for k, v in fields.items() if v is not None}, ChatCompletionRequest)


def _text_parts(content: str | list, where: str) -> str:
    """A message's content: a string or text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidParameter(f"{where}: content is a string or a list of parts", param=where)
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise InvalidParameter(f"{where}.{index}: only text parts are supported (input_text, output_text), "
                                   f"got {kind!r}", param=f"{where}.{index}")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidParameter(f"{where}.{key}: a string is required", param=f"{where}.{key}")
    return value


def _add_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    """One input item -> chat messages; consecutive function_call items join one assistant turn."""
    if not isinstance(item, dict):
        raise InvalidParameter(f"{where}: an input item is an object", param=where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise InvalidParameter(f"{where}.role must be user, assistant, system or developer, got {role!r}",
                                   param=f"{where}.role")
        messages.append({"role": role, "content": _text_parts(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        call = {"id": _string(item, "call_id", where), "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                         "content": _text_parts(output, f"{where}.output")})
    elif kind == "reasoning":
        return  # earlier reasoning: chat templates drop it
    elif kind == "item_reference":
        raise InvalidParameter(f"{where}: item references need stored responses, which this server does not keep",
                               param=where)
    else:
        raise InvalidParameter(f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                               f"function_call_output, reasoning)", param=where)


def _function_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    """A Responses function tool ({type, name, description, parameters, strict}) -> a chat function tool."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise InvalidParameter(f"{where}: only function tools are supported, got {kind!r}", param=where)
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # none, auto, required: the chat path checks it
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise InvalidParameter('a named tool_choice is {"type": "function", "name": "..."}', param="tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text_format: Any) -> dict[str, Any] | None:
    """text.format -> the chat request's response_format (None for plain text)."""
    if text_format is None:
        return None
    if not isinstance(text_format, dict):
        raise InvalidParameter("text.format must be an object", param="text.format")
    kind = text_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {key: text_format[key] for key in ("name", "schema", "strict") if key in text_format}
        return {"type": "json_schema", "json_schema": spec}
    raise InvalidParameter(f"text.format.type must be text, json_object or json_schema, got {kind!r}",
                           param="text.format.type")
