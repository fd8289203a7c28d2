"""POST /v1/responses: OpenAI's Responses API (stateless) on the chat path.

The request is translated (responses_protocol.py) and run by the chat completions handler
(chat_adapter.py); the reply's parts become output items: "reasoning" (when the chat path has a
reasoning parser), "message" with one output_text part, and "function_call" per tool call. A
reply cut by max_output_tokens is "incomplete". Streaming sends the API's events, each with its
sequence_number: response.created, response.in_progress, then per item response.output_item.added,
its content (response.content_part.added, response.output_text.delta / .done,
response.content_part.done; response.function_call_arguments.delta / .done; response.reasoning_text.delta
/ .done), response.output_item.done, and finally response.completed (or response.incomplete). A
failure mid-stream is an `error` event. Nothing is kept once the response is sent.
"""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse

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
from deepinfer.core.server.responses_protocol import ResponsesRequest
from deepinfer.core.server.serving import EventStreamResponse, ServingEngine


def prepare_response(serving: ServingEngine, body: bytes) -> TranslatedRequest:
    return prepare_translated(serving, body, ResponsesRequest)


def _item_id(part: Part) -> str:
    prefix = {REASONING: "rs", TEXT: "msg"}.get(part.kind, "fc")
    return f"{prefix}_{uuid.uuid4().hex}"


def _item(part: Part, item_id: str, status: str) -> dict:
    """A part as an output item (`status` in_progress while it streams)."""
    if part.kind == REASONING:
        return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": part.text}]}
    if part.kind == TEXT:
        return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                "content": [_text_part(part.text)] if status != "in_progress" else []}
    return {"type": "function_call", "id": item_id, "call_id": part.call_id, "name": part.name,
            "arguments": part.text, "status": status}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(chat_usage: dict | None) -> dict | None:
    if chat_usage is None:
        return None
    details = chat_usage.get("completion_tokens_details") or {}
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": (chat_usage.get("prompt_tokens_details") or {}).get(
                "cached_tokens", 0)},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
            "total_tokens": chat_usage["total_tokens"]}


class _Envelope:
    """The response object around the output: the request's settings echoed, as OpenAI's does."""

    def __init__(self, serving: ServingEngine, request: ResponsesRequest):
        self.fields = {
            "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "model": serving.model_name, "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens, "temperature": request.temperature,
            "top_p": request.top_p, "tools": request.tools or [], "tool_choice": request.tool_choice or "auto",
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "text": {"format": (request.text or {}).get("format") or {"type": "text"}},
            "reasoning": request.reasoning or {"effort": None, "summary": None}, "truncation": "disabled",
            "previous_response_id": None, "store": False, "user": request.user, "metadata": request.metadata or {},
        }

    def __call__(self, status: str, output: list[dict], usage: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {**self.fields, "status": status, "error": None, "incomplete_details": incomplete,
                "output": output, "usage": usage}


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


async def create_response(serving: ServingEngine, response: TranslatedRequest, raw_request: Request):
    request, chat, prepared = response
    envelope = _Envelope(serving, request)
    if not chat.stream:
        body = await chat_completion(serving, chat, prepared, raw_request)
        choice = body["choices"][0]
        status = _status(choice["finish_reason"])
        item_status = "incomplete" if status == "incomplete" else "completed"
        output = [_item(part, _item_id(part), item_status) for part in message_parts(choice["message"])]
        return JSONResponse(envelope(status, output, _usage(body["usage"])))

    chunks, on_close = await chat_chunks(serving, chat, prepared, raw_request)
    return EventStreamResponse(_events(envelope, chunks), on_close=on_close)


async def _events(envelope: _Envelope, chunks):
    sequence = 0
    reply = ReplyStream()
    ids: dict[int, str] = {}  # part index -> its item id
    done: list[dict] = []  # the finished items

    def event(kind: str, **fields) -> str:
        nonlocal sequence
        sequence += 1
        return named_sse(kind, {"type": kind, "sequence_number": sequence - 1, **fields})

    def item_events(delta: PartDelta) -> list[str]:
        part = delta.part
        if delta.opened:
            ids[part.index] = _item_id(part)
        where = {"item_id": ids[part.index], "output_index": part.index}
        if delta.opened:
            opened = [event("response.output_item.added", output_index=part.index,
                            item=_item(part, ids[part.index], "in_progress"))]
            if part.kind == TEXT:
                opened.append(event("response.content_part.added", **where, content_index=0, part=_text_part("")))
            return opened
        if not delta.closed:
            if part.kind == TEXT:
                return [event("response.output_text.delta", **where, content_index=0, delta=delta.text, logprobs=[])]
            if part.kind == REASONING:
                return [event("response.reasoning_text.delta", **where, content_index=0, delta=delta.text)]
            return [event("response.function_call_arguments.delta", **where, delta=delta.text)]
        if part.kind == TEXT:
            closing = [event("response.output_text.done", **where, content_index=0, text=part.text, logprobs=[]),
                       event("response.content_part.done", **where, content_index=0, part=_text_part(part.text))]
        elif part.kind == REASONING:
            closing = [event("response.reasoning_text.done", **where, content_index=0, text=part.text)]
        else:
            closing = [event("response.function_call_arguments.done", **where, name=part.name,
                             arguments=part.text)]
        # a part still open when max_output_tokens cut the reply is incomplete, as the non-streamed answer says
        done.append(_item(part, ids[part.index], "incomplete" if reply.finish_reason == "length" else "completed"))
        return [*closing, event("response.output_item.done", output_index=part.index, item=done[-1])]

    try:
        yield event("response.created", response=envelope("in_progress", []))
        yield event("response.in_progress", response=envelope("in_progress", []))
        async for chunk in chunks:
            if "error" in chunk:  # the engine failed mid-stream (the chat path's in-band error)
                error = chunk["error"]
                yield event("error", code=error.get("code"), message=error.get("message", ""),
                            param=error.get("param"))
                return
            for delta in reply.feed(chunk):
                for text in item_events(delta):
                    yield text
        for delta in reply.close():
            for text in item_events(delta):
                yield text
        status = _status(reply.finish_reason)
        yield event(f"response.{status}", response=envelope(status, done, _usage(reply.usage)))
    finally:
        await chunks.aclose()
