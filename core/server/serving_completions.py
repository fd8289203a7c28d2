"""POST /v1/completions: text or token-id prompts -> engine -> OpenAI text completion (or chunks).

A request may carry a list of prompts (strings or token-id lists). Each becomes its own engine
request with `n` samples; choice `prompt_index * n + sample_index` is the sample's, as OpenAI
numbers them, and usage adds up every prompt. With `echo`, each choice's text starts with its
prompt, and with `logprobs` so do its logprobs (the engine scores the prompt: SamplingParams.prompt_logprobs);
`max_tokens: 0` with echo answers the prompt alone. vLLM's `prompt_logprobs` puts the prompt's logprobs
in its own shape on each choice. A structured-output constraint applies to every prompt's samples.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from deepinfer.core.engine.frontend.outputs import CompletionOutput, RequestOutput
from deepinfer.core.server.logprobs import completion_logprobs, vllm_prompt_logprobs
from deepinfer.core.server.preprocess import is_small_body, parse_body
from deepinfer.core.server.protocol import CompletionRequest
from deepinfer.core.server.serving import (
    EventStreamResponse,
    PreparedPrompt,
    ServingEngine,
    SSETemplate,
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
    streams = await serving.submit(prompts, request_id, request.tenant, is_small_body(raw_request))
    n = request.n
    num_top = request.logprobs or 0
    created = int(time.time())

    echo_only = request.echo_only  # the generated token is dropped: text, logprobs and usage are the prompt's

    def logprobs_of(entries, text_offset: int = 0, output: RequestOutput | None = None) -> dict | None:
        """`output`: the choice's first logprobs with echo, which start with its prompt's."""
        if request.logprobs is None:
            return None
        prompt_ids = output.prompt_token_ids if output is not None and request.echo else None
        return completion_logprobs([] if echo_only else entries, num_top, serving.token_text, text_offset,
                                   prompt_ids, output.prompt_logprobs if prompt_ids else None)

    def echo_of(prompt_index: int) -> str:
        return prompts[prompt_index].text or ""

    def generated(text: str) -> str:
        return "" if echo_only else text

    def usage_of(outputs: list[RequestOutput]) -> dict:
        counts = usage(outputs)
        if echo_only:
            counts.update(completion_tokens=0, total_tokens=counts["prompt_tokens"])
        return counts

    def prompt_logprobs_field(output: RequestOutput) -> dict:
        if request.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": vllm_prompt_logprobs(output.prompt_logprobs, request.prompt_logprobs,
                                                        serving.token_text)}

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
                "text": echo_of(prompt_index) + generated(c.text),
                "logprobs": logprobs_of(c.logprobs or [], output=output),
                "finish_reason": c.finish_reason,
                **prompt_logprobs_field(output),
            } for prompt_index, output in enumerate(outputs) for c in output.outputs],
            "usage": usage_of(outputs),
            "system_fingerprint": None,
        })

    usage_field = {"usage": None} if request.include_usage else {}
    # Per choice: how much token text its earlier chunks' logprobs covered (text_offset continues from there).
    logprob_text_length: dict[int, int] = {}
    started: set[int] = set()  # choices whose first chunk (carrying the echoed prompt) was sent

    def payload(choice: dict) -> dict:
        return {"id": request_id, "object": "text_completion", "created": created, "model": serving.model_name,
                "system_fingerprint": None, "choices": [choice], **usage_field}

    # Without logprobs a chunk's JSON is this template around the choice's index, text and finish reason.
    slot = SSETemplate.slot
    template = SSETemplate(payload({"index": slot(0), "text": slot(1), "logprobs": None,
                                    "finish_reason": slot(2)}), 3) if request.logprobs is None else None

    def chunk_of(prompt_index: int, output: RequestOutput, completion: CompletionOutput) -> dict | str | None:
        index = prompt_index * n + completion.index
        first = index not in started
        if not (first or completion.delta_text or completion.delta_logprobs or completion.finish_reason):
            return None
        text = generated(completion.delta_text)
        if first:
            started.add(index)
            text = echo_of(prompt_index) + text
        if template is not None:
            return template.render(index, text, completion.finish_reason)
        offset = logprob_text_length.get(index, 0)
        logprobs = logprobs_of(completion.delta_logprobs or [], offset, output if first else None)
        logprob_text_length[index] = offset + sum(len(t) for t in logprobs["tokens"])
        return payload({"index": index, "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason})

    def chunks_of(prompt_index: int, output: RequestOutput) -> list[dict | str]:
        chunks = (chunk_of(prompt_index, output, c) for c in output.outputs)
        return [chunk for chunk in chunks if chunk is not None]

    def final_chunks(outputs: list[RequestOutput]) -> list[dict]:
        if not request.include_usage:
            return []
        return [{"id": request_id, "object": "text_completion", "created": created, "model": serving.model_name,
                 "system_fingerprint": None, "choices": [], "usage": usage_of(outputs)}]

    return EventStreamResponse(stream_events(serving, streams, chunks_of, final_chunks),
                               on_close=lambda: serving.release(streams))
