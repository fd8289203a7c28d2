"""POST /v1/chat/completions: messages -> chat template -> engine -> OpenAI chat completion (or chunks)."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from deepinfer.core.engine.outputs import CompletionOutput, RequestOutput
from deepinfer.core.server.chat_format import render_chat_prompt
from deepinfer.core.server.logprobs import chat_logprobs
from deepinfer.core.server.preprocess import parse_body
from deepinfer.core.server.protocol import ChatCompletionRequest
from deepinfer.core.server.serving import (
    EventStreamResponse,
    PreparedPrompt,
    ServingEngine,
    check_finished,
    final_outputs,
    new_request_id,
    stream_events,
    usage,
)
from deepinfer.core.server.unsupported import CHAT


def prepare_chat(serving: ServingEngine, body: bytes) -> tuple[ChatCompletionRequest, PreparedPrompt]:
    """Parse, validate, render and tokenize (a preprocessing thread)."""
    request = parse_body(body, ChatCompletionRequest, CHAT)
    request.check()
    serving.check_model(request.model)
    prompt = render_chat_prompt(serving.engine.tokenizer, request.messages, request.add_generation_prompt)
    prompt_ids = serving.tokenize(prompt, param="messages", add_special_tokens=request.add_special_tokens)
    return request, PreparedPrompt(prompt_ids, serving.sampling_params(request, prompt_ids))


async def create_chat_completion(serving: ServingEngine, request: ChatCompletionRequest, prompt: PreparedPrompt,
                                 raw_request: Request):
    request_id = new_request_id("chatcmpl")
    streams = serving.submit([prompt], request_id, request.tenant)
    num_top = request.top_logprobs or 0
    created = int(time.time())

    def logprobs_of(entries) -> dict | None:
        return chat_logprobs(entries, num_top, serving.token_text) if request.logprobs else None

    if not request.stream:
        (output,) = await final_outputs(serving, streams, raw_request)
        check_finished([output])
        return JSONResponse({
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": serving.model_name,
            "choices": [{
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs_of(c.logprobs or []),
                "finish_reason": c.finish_reason,
            } for c in output.outputs],
            "usage": usage([output]),
            "system_fingerprint": None,
        })

    usage_field = {"usage": None} if request.include_usage else {}
    sent_role: set[int] = set()

    def chunk(choice: dict) -> dict:
        return {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": serving.model_name, "system_fingerprint": None, "choices": [choice], **usage_field}

    def choice_delta(completion: CompletionOutput) -> dict | None:
        has_news = completion.delta_text or completion.delta_logprobs or completion.finish_reason
        if completion.index in sent_role and not has_news:
            return None
        delta = {"content": completion.delta_text}
        if completion.index not in sent_role:
            delta["role"] = "assistant"
            sent_role.add(completion.index)
        logprobs = logprobs_of(completion.delta_logprobs or []) if completion.delta_logprobs else None
        return {"index": completion.index, "delta": delta, "logprobs": logprobs,
                "finish_reason": completion.finish_reason}

    def chunks_of(_: int, output: RequestOutput) -> list[dict]:
        choices = (choice_delta(c) for c in output.outputs)
        return [chunk(choice) for choice in choices if choice is not None]

    def final_chunks(outputs: list[RequestOutput]) -> list[dict]:
        if not request.include_usage:
            return []
        return [{"id": request_id, "object": "chat.completion.chunk", "created": created,
                 "model": serving.model_name, "system_fingerprint": None, "choices": [], "usage": usage(outputs)}]

    return EventStreamResponse(stream_events(serving, streams, chunks_of, final_chunks),
                               on_close=lambda: serving.release(streams))
