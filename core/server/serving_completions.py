"""POST /v1/completions: text or token-id prompts -> engine -> OpenAI text completion (or chunks).

A request may carry a list of prompts (strings or token-id lists). Each becomes its own engine
request with `n` samples; choice `prompt_index * n + sample_index` is the sample's, as OpenAI
numbers them, and usage adds up every prompt. With `echo`, each choice's text starts with its
prompt. A structured-output constraint applies to every prompt's samples.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from deepinfer.core.engine.frontend.outputs import CompletionOutput, RequestOutput
from deepinfer.core.server.logprobs import completion_logprobs
from deepinfer.core.server.preprocess import parse_body
from deepinfer.core.server.protocol import CompletionRequest
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
from deepinfer.core.server.unsupported import COMPLETIONS


def prepare_completion(serving: ServingEngine, body: bytes) -> tuple[CompletionRequest, list[PreparedPrompt]]:
    """Parse, validate and tokenize every prompt (a preprocessing thread)."""
    request = parse_body(body, CompletionRequest, COMPLETIONS)
    request.check()
    serving.check_model(request.model)
    prompts = request.prompts()
    constraint = request.structured_outputs_params()
    prepared = []
    for index, prompt in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt.{index}"
        if isinstance(prompt, str):
            token_ids = serving.tokenize(prompt, param=param, add_special_tokens=request.add_special_tokens)
            text = prompt
        else:
            token_ids = serving.check_token_ids(prompt, param=param)
            text = serving.engine.tokenizer.decode(token_ids, skip_special_tokens=False) if request.echo else None
        params = serving.sampling_params(request, token_ids, num_prompts=len(prompts), structured_outputs=constraint)
        params = params.with_defaults(serving.engine.sampling_defaults)  # unset fields: the model's defaults
        prepared.append(PreparedPrompt(token_ids, params, text if request.echo else None))
    return request, prepared


async def create_completion(serving: ServingEngine, request: CompletionRequest, prompts: list[PreparedPrompt],
                            raw_request: Request):
    await serving.compile_constraint(prompts[0].params.structured_outputs, request.structured_outputs_param())
    request_id = new_request_id("cmpl")
    streams = await serving.submit(prompts, request_id, request.tenant)
    n = request.n
    num_top = request.logprobs or 0
    created = int(time.time())

    def logprobs_of(entries, text_offset: int = 0) -> dict | None:
        if request.logprobs is None:
            return None
        return completion_logprobs(entries, num_top, serving.token_text, text_offset)

    def echo_of(prompt_index: int) -> str:
        return prompts[prompt_index].text or ""

    if not request.stream:
        outputs = await final_outputs(serving, streams, raw_request)
        check_finished(outputs)
        return JSONResponse({
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": serving.model_name,
            "choices": [{
                "index": prompt_index * n + c.index,
                "text": echo_of(prompt_index) + c.text,
                "logprobs": logprobs_of(c.logprobs or []),
                "finish_reason": c.finish_reason,
            } for prompt_index, output in enumerate(outputs) for c in output.outputs],
            "usage": usage(outputs),
            "system_fingerprint": None,
        })

    usage_field = {"usage": None} if request.include_usage else {}
    # Per choice: how much token text its earlier chunks' logprobs covered (text_offset continues from there).
    logprob_text_length: dict[int, int] = {}
    started: set[int] = set()  # choices whose first chunk (carrying the echoed prompt) was sent

    def choice_delta(prompt_index: int, completion: CompletionOutput) -> dict | None:
        if not (completion.delta_text or completion.delta_logprobs or completion.finish_reason):
            return None
        index = prompt_index * n + completion.index
        text = completion.delta_text
        if index not in started:
            started.add(index)
            text = echo_of(prompt_index) + text
        logprobs = None
        if request.logprobs is not None:
            offset = logprob_text_length.get(index, 0)
            logprobs = logprobs_of(completion.delta_logprobs or [], offset)
            logprob_text_length[index] = offset + sum(len(t) for t in logprobs["tokens"])
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason}

    def chunks_of(prompt_index: int, output: RequestOutput) -> list[dict]:
        choices = (choice_delta(prompt_index, c) for c in output.outputs)
        return [{"id": request_id, "object": "text_completion", "created": created, "model": serving.model_name,
                 "system_fingerprint": None, "choices": [choice], **usage_field}
                for choice in choices if choice is not None]

    def final_chunks(outputs: list[RequestOutput]) -> list[dict]:
        if not request.include_usage:
            return []
        return [{"id": request_id, "object": "text_completion", "created": created, "model": serving.model_name,
                 "system_fingerprint": None, "choices": [], "usage": usage(outputs)}]

    return EventStreamResponse(stream_events(serving, streams, chunks_of, final_chunks),
                               on_close=lambda: serving.release(streams))
