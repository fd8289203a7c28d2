"""POST /v1/completions: a text or token-id prompt -> engine -> OpenAI text completion (or chunks)."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from deepinfer.core.engine.outputs import CompletionOutput, RequestOutput
from deepinfer.core.server.logprobs import completion_logprobs
from deepinfer.core.server.protocol import CompletionRequest
from deepinfer.core.server.serving import (
    EventStreamResponse,
    ServingEngine,
    check_finished,
    final_output,
    new_request_id,
    stream_events,
    usage,
)


async def create_completion(serving: ServingEngine, request: CompletionRequest, raw_request: Request):
    request.check()
    serving.check_model(request.model)
    prompt_ids = serving.tokenize(request.single_prompt(), param="prompt")
    constraint = request.structured_outputs_params()
    await serving.compile_constraint(constraint, "response_format")
    params = serving.sampling_params(request, prompt_ids, constraint)
    request_id = new_request_id("cmpl")
    stream = serving.submit(prompt_ids, params, request_id, request.tenant)
    num_top = request.logprobs or 0
    created = int(time.time())

    def logprobs_of(entries, text_offset: int = 0) -> dict | None:
        if request.logprobs is None:
            return None
        return completion_logprobs(entries, num_top, serving.token_text, text_offset)

    if not request.stream:
        output = await final_output(stream, raw_request)
        check_finished(output)
        return JSONResponse({
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": serving.model_name,
            "choices": [{
                "index": c.index,
                "text": c.text,
                "logprobs": logprobs_of(c.logprobs or []),
                "finish_reason": c.finish_reason,
            } for c in output.outputs],
            "usage": usage(output),
            "system_fingerprint": None,
        })

    usage_field = {"usage": None} if request.include_usage else {}
    # Per choice: how much token text its earlier chunks' logprobs covered (text_offset continues from there).
    logprob_text_length: dict[int, int] = {}

    def choice_delta(completion: CompletionOutput) -> dict | None:
        if not (completion.delta_text or completion.delta_logprobs or completion.finish_reason):
            return None
        logprobs = None
        if request.logprobs is not None:
            offset = logprob_text_length.get(completion.index, 0)
            logprobs = logprobs_of(completion.delta_logprobs or [], offset)
            logprob_text_length[completion.index] = offset + sum(len(t) for t in logprobs["tokens"])
        return {"index": completion.index, "text": completion.delta_text, "logprobs": logprobs,
                "finish_reason": completion.finish_reason}

    def chunks_of(output: RequestOutput) -> list[dict]:
        choices = (choice_delta(c) for c in output.outputs)
        return [{"id": request_id, "object": "text_completion", "created": created, "model": serving.model_name,
                 "system_fingerprint": None, "choices": [choice], **usage_field}
                for choice in choices if choice is not None]

    def final_chunks(output: RequestOutput) -> list[dict]:
        if not request.include_usage:
            return []
        return [{"id": request_id, "object": "text_completion", "created": created, "model": serving.model_name,
                 "system_fingerprint": None, "choices": [], "usage": usage(output)}]

    return EventStreamResponse(stream_events(stream, chunks_of, final_chunks))
