"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat path.

The request is translated (anthropic_protocol.py) and run by the chat completions handler
(chat_adapter.py); its reply comes back as Anthropic content blocks: a "thinking" block for the
reasoning part (when the chat path has a reasoning parser), "text", and "tool_use" with the
arguments parsed into `input`. Streaming sends Anthropic's events: message_start, ping, then per
block content_block_start / content_block_delta (text_delta, thinking_delta, input_json_delta) /
content_block_stop, then message_delta (stop_reason, output tokens) and message_stop; a failure
mid-stream is an `error` event. Errors are in Anthropic's shape (errors.py).
"""

from __future__ import annotations

import json
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse

from deepinfer.core.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from deepinfer.core.server.chat_adapter import (
    REASONING,
    TEXT,
    Part,
    PartDelta,
    ReplyStream,
    TranslatedRequest,
    chat_chunks,
    chat_completion,
    message_parts,
    named_sse,
    prepare_translated,
)
from deepinfer.core.server.chat_format import render_chat_prompt
from deepinfer.core.server.errors import InvalidParameter, anthropic_error_body
from deepinfer.core.server.preprocess import parse_json_object, validate
from deepinfer.core.server.serving import EventStreamResponse, ServingEngine
from deepinfer.core.server.serving_chat import template_variables

# Chat finish_reason -> Anthropic stop_reason ("stop" is end_turn unless a stop sequence ended it).
# "abort" (the server ended the request at shutdown) has no Anthropic reason; the turn just ends.
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}
_STATUS_BY_CHAT_ERROR = {"invalid_request_error": 400, "rate_limit_error": 429, "service_unavailable": 503}


def prepare_message(serving: ServingEngine, body: bytes) -> TranslatedRequest:
    return prepare_translated(serving, body, MessagesRequest)


def count_tokens(serving: ServingEngine, body: bytes) -> dict:
    """The prompt's tokens as the model would see them (template, tools and `thinking`'s template variable),
    like /tokenize: no length limit."""
    chat = validate(parse_json_object(body), CountTokensRequest).chat_request()
    serving.check_model(chat.model)
    tokenizer = serving.engine.tokenizer
    text = render_chat_prompt(tokenizer, chat.messages, True, serving.tool_parser, serving.tool_plan(chat),
                              template_variables(serving, chat))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidParameter(f"the text is not valid Unicode: {err.reason} at position {err.start}",
                               param="messages") from None
    return {"input_tokens": len(tokenizer.encode(text, add_special_tokens=False))}


def _stop(finish_reason: str | None, stop_reason, stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of the reply."""
    if finish_reason == "stop" and isinstance(stop_reason, str) and stop_reason in (stop_sequences or []):
        return "stop_sequence", stop_reason
    return _STOP_REASONS.get(finish_reason, "end_turn"), None


def _usage(chat_usage: dict | None, input_tokens: int) -> dict:
    """Anthropic's usage: input_tokens excludes what the prefix cache held (cache_read_input_tokens)."""
    chat_usage = chat_usage or {}
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": input_tokens - cached, "output_tokens": chat_usage.get("completion_tokens", 0),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _block(part: Part) -> dict:
    """A finished part as an Anthropic content block."""
    if part.kind == REASONING:
        return {"type": "thinking", "thinking": part.text, "signature": ""}
    if part.kind == TEXT:
        return {"type": "text", "text": part.text}
    return {"type": "tool_use", "id": part.call_id, "name": part.name, "input": json.loads(part.text or "{}")}


def _empty_block(part: Part) -> dict:
    """The block as content_block_start opens it."""
    if part.kind == REASONING:
        return {"type": "thinking", "thinking": "", "signature": ""}
    if part.kind == TEXT:
        return {"type": "text", "text": ""}
    return {"type": "tool_use", "id": part.call_id, "name": part.name, "input": {}}


def _delta(part: Part, text: str) -> dict:
    if part.kind == REASONING:
        return {"type": "thinking_delta", "thinking": text}
    if part.kind == TEXT:
        return {"type": "text_delta", "text": text}
    return {"type": "input_json_delta", "partial_json": text}


async def create_message(serving: ServingEngine, message: TranslatedRequest, raw_request: Request):
    anthropic, chat, prepared = message
    message_id = f"msg_{uuid.uuid4().hex}"  # Anthropic's id shape
    input_tokens = len(prepared.prompt.token_ids)
    head = {"id": message_id, "type": "message", "role": "assistant", "model": serving.model_name}
    if not chat.stream:
        body = await chat_completion(serving, chat, prepared, raw_request)
        choice = body["choices"][0]
        stop_reason, stop_sequence = _stop(choice["finish_reason"], choice.get("stop_reason"),
                                           anthropic.stop_sequences)
        return JSONResponse({**head, "content": [_block(part) for part in message_parts(choice["message"])],
                             "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                             "usage": _usage(body["usage"], input_tokens)})

    chunks, on_close = await chat_chunks(serving, chat, prepared, raw_request)

    async def events():
        reply = ReplyStream()
        try:
            start = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                     "usage": _usage(None, input_tokens)}
            yield named_sse("message_start", {"type": "message_start", "message": start})
            yield named_sse("ping", {"type": "ping"})
            async for chunk in chunks:
                if "error" in chunk:  # the engine failed mid-stream (the chat path's in-band error)
                    error = chunk["error"]
                    status = _STATUS_BY_CHAT_ERROR.get(error.get("type"), 500)
                    yield named_sse("error", anthropic_error_body(status, error.get("message", "")))
                    return
                for delta in reply.feed(chunk):
                    yield _block_event(delta)
            for delta in reply.close():
                yield _block_event(delta)
            stop_reason, stop_sequence = _stop(reply.finish_reason, reply.stop_reason, anthropic.stop_sequences)
            usage = _usage(reply.usage, input_tokens)
            yield named_sse("message_delta", {
                "type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": usage})
            yield named_sse("message_stop", {"type": "message_stop"})
        finally:
            await chunks.aclose()

    return EventStreamResponse(events(), on_close=on_close)


def _block_event(delta: PartDelta) -> str:
    part = delta.part
    if delta.opened:
        return named_sse("content_block_start", {"type": "content_block_start", "index": part.index,
                                                 "content_block": _empty_block(part)})
    if delta.closed:
        return named_sse("content_block_stop", {"type": "content_block_stop", "index": part.index})
    return named_sse("content_block_delta", {"type": "content_block_delta", "index": part.index,
                                             "delta": _delta(part, delta.text)})

