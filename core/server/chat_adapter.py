"""Another API's request run on the chat path, its answer read back in parts, as vLLM's Messages API does.

The Messages and Responses APIs translate their request into a ChatCompletionRequest, which goes
through `prepare_chat_request` and `create_chat_completion` unchanged: the same chat template,
tool parser, sampling defaults, structured outputs and limits. The chat completion that comes back
(its JSON body, or the chunks of its event stream) is read here as a reply of ordered parts, each
reasoning, text or one tool call, for the caller to write in its own format.

Reasoning: a chat message or delta's `reasoning_content` (vLLM's and DeepSeek's field, set by the
chat path's reasoning parser) becomes a "reasoning" part ahead of the text; a chat path without a
reasoning parser sends none, and the reply has no reasoning part.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from starlette.requests import Request

from deepinfer.core.server.preprocess import parse_json_object, validate
from deepinfer.core.server.protocol import ChatCompletionRequest
from deepinfer.core.server.serving import ServingEngine, sse_json
from deepinfer.core.server.serving_chat import PreparedChat, create_chat_completion, prepare_chat_request

REASONING, TEXT, TOOL_CALL = "reasoning", "text", "tool_call"



class TranslatedRequest(NamedTuple):
    """Another API's request (a pydantic model with `to_chat_request()`), its chat translation, and the chat
    path's preparation of that."""

    request: Any
    chat: ChatCompletionRequest
    prepared: PreparedChat


def prepare_translated(serving: ServingEngine, body: bytes, request_type: type) -> TranslatedRequest:
    """Parse `body` as `request_type` and translate it, then the chat path's own preparation (on a
    preprocessing thread)."""
    request = validate(parse_json_object(body), request_type)
    chat, prepared = prepare_chat_request(serving, request.to_chat_request())
    return TranslatedRequest(request, chat, prepared)


@dataclass
class Part:
    """One part of the reply, in the order the model wrote it."""

    index: int  # its position in the reply: Anthropic's content block index, the Responses output_index
    kind: str  # REASONING, TEXT or TOOL_CALL
    text: str = ""  # what it holds so far; a tool call's arguments (JSON text)
    call_id: str | None = None  # a tool call's id and function name
    name: str | None = None


def message_parts(message: dict) -> list[Part]:
    """A non-streamed chat completion's message -> its parts (reasoning, text, tool calls)."""
    parts: list[Part] = []
    if message.get("reasoning_content"):
        parts.append(Part(len(parts), REASONING, message["reasoning_content"]))
    if message.get("content"):
        parts.append(Part(len(parts), TEXT, message["content"]))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        parts.append(Part(len(parts), TOOL_CALL, function["arguments"], call["id"], function["name"]))
    return parts


@dataclass
class PartDelta:
    """What one chunk adds to the reply: a part opens (`opened`), grows by `text`, or closes (`closed`)."""

    part: Part
    text: str = ""
    opened: bool = False
    closed: bool = False


@dataclass
class ReplyStream:
    """A streamed chat completion's chunks -> PartDeltas. A part closes when the next one opens or
    the reply ends: the parts of a reply follow one another, as Anthropic's blocks and the Responses
    output items do."""

    parts: list[Part] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: dict | None = None
    _calls: dict[int, Part] = field(default_factory=dict)  # the chat delta's tool-call index -> its part

    @property
    def current(self) -> Part | None:
        return self.parts[-1] if self.parts else None

    def _open(self, kind: str, call_id: str | None = None, name: str | None = None) -> list[PartDelta]:
        deltas = [PartDelta(self.current, closed=True)] if self.current is not None else []
        self.parts.append(Part(len(self.parts), kind, call_id=call_id, name=name))
        return [*deltas, PartDelta(self.current, opened=True)]

    def _grow(self, kind: str, text: str) -> list[PartDelta]:
        deltas = self._open(kind) if self.current is None or self.current.kind != kind else []
        self.current.text += text
        return [*deltas, PartDelta(self.current, text=text)]

    def feed(self, chunk: dict) -> list[PartDelta]:
        """One chat.completion.chunk (the final usage chunk included)."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        deltas: list[PartDelta] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                deltas += self._grow(REASONING, delta["reasoning_content"])
            if delta.get("content"):
                deltas += self._grow(TEXT, delta["content"])
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if call.get("id") is not None:
                    deltas += self._open(TOOL_CALL, call["id"], function.get("name"))
                    self._calls[call["index"]] = self.current
                part = self._calls.get(call["index"])
                if part is not None and function.get("arguments"):
                    part.text += function["arguments"]
                    deltas.append(PartDelta(part, text=function["arguments"]))
            if choice.get("finish_reason") is not None:
                self.finish_reason, self.stop_reason = choice["finish_reason"], choice.get("stop_reason")
        return deltas

    def close(self) -> list[PartDelta]:
        """The reply ended: the last part closes."""
        return [PartDelta(self.current, closed=True)] if self.current is not None else []


async def chat_completion(serving: ServingEngine, request: ChatCompletionRequest, prepared: PreparedChat,
                          raw_request: Request) -> dict:
    """The non-streamed chat completion of a translated request, as its JSON body."""
    response = await create_chat_completion(serving, request, prepared, raw_request)
    return json.loads(response.body)


async def chat_chunks(serving: ServingEngine, request: ChatCompletionRequest, prepared: PreparedChat,
                      raw_request: Request):
    """The streamed chat completion of a translated request -> (its chunks as dicts, on_close). An
    in-band error is a chunk {"error": {...}}. Closing the iterator (or calling `on_close` when it
    never started) aborts the engine request."""
    response = await create_chat_completion(serving, request, prepared, raw_request)
    return _read_chunks(response.body_iterator), response.on_close


async def _read_chunks(writes: AsyncIterator[str]) -> AsyncIterator[dict]:
    """The chunks of the chat stream's writes (each one or more `data: ...` events)."""
    try:
        async for write in writes:
            for event in write.split("\n\n")[:-1]:  # every event ends with a blank line
                data = event.removeprefix("data: ")
                if data == "[DONE]":
                    return
                yield json.loads(data)
    finally:
        await writes.aclose()


def named_sse(event: str, payload: dict) -> str:
    """One server-sent event with its name, as Anthropic and the Responses API stream them."""
    return f"event: {event}\ndata: {sse_json(payload)}\n\n"
