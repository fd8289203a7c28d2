"""POST /v1/chat/completions: messages -> chat template -> engine -> OpenAI chat completion (or chunks).

With tools, the reply goes through the server's tool parser: a non-streaming answer carries the
parsed `tool_calls` (and the content outside them), a stream sends OpenAI's tool-call deltas (id
and name first, then argument fragments); a reply with calls finishes with "tool_calls".
A finished choice carries vLLM's `stop_reason`: the stop string or stop token id that ended it
(null for the end-of-sequence token and for "length").

With a reasoning parser (core/reasoning), the reply's reasoning is `reasoning_content` beside
`content` (DeepSeek's and vLLM's shape: a message field, and a delta field while it streams), tool
calls are parsed from the content only, and a structured-output or tool_choice constraint starts
where the reasoning ends (core/structured/reasoning_gate.py). `max_tokens` counts both parts;
vLLM's `thinking_token_budget` caps the reasoning alone (the gate forces its end marker).
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

from starlette.requests import Request
from starlette.responses import JSONResponse

from deepinfer.core.engine.frontend.outputs import CompletionOutput, RequestOutput
from deepinfer.core.reasoning import ReasoningParser, ReasoningSplit, ReasoningStream
from deepinfer.core.server.chat_format import render_chat_prompt
from deepinfer.core.server.errors import InvalidParameter
from deepinfer.core.server.logprobs import chat_logprobs, vllm_prompt_logprobs
from deepinfer.core.server.preprocess import is_small_body, parse_body
from deepinfer.core.server.protocol import ChatCompletionRequest
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
from deepinfer.core.server.unsupported import CHAT
from deepinfer.core.structured.params import StructuredOutputsParams
from deepinfer.core.structured.reasoning_gate import ReasoningSpan
from deepinfer.core.structured.tool_parsers import ToolCallStream
from deepinfer.core.structured.tools import ToolPlan


class PreparedChat(NamedTuple):
    prompt: PreparedPrompt
    plan: ToolPlan | None  # the request's tools and tool_choice
    constraint: StructuredOutputsParams | None  # compiled on the event loop's grammar workers before submitting
    constraint_param: str | None  # the request field a constraint error names
    reasoning: ReasoningSplit | None  # how the reply splits into reasoning and content (None: no parser)


def prepare_chat(serving: ServingEngine, body: bytes) -> tuple[ChatCompletionRequest, PreparedChat]:
    """Parse, validate, render and tokenize (a preprocessing thread)."""
    return prepare_chat_request(serving, parse_body(body, ChatCompletionRequest, CHAT))


def prepare_chat_request(serving: ServingEngine, request: ChatCompletionRequest
                         ) -> tuple[ChatCompletionRequest, PreparedChat]:
    """`prepare_chat` after parsing: also the path of the Messages and Responses APIs' translated requests."""
    request.check()
    serving.check_model(request.model)
    plan = serving.tool_plan(request)
    tokenizer = serving.engine.tokenizer
    prompt = render_chat_prompt(tokenizer, request.messages, request.add_generation_prompt, serving.tool_parser,
                                plan, template_variables(serving, request))
    reasoning = reasoning_split(serving.reasoning_parser, prompt)
    prompt_ids = serving.tokenize(prompt, param="messages", add_special_tokens=request.add_special_tokens)
    constraint, param = request.structured_outputs_params(), request.structured_outputs_param()
    if plan is not None and plan.constraint is not None:
        if constraint is not None:
            raise InvalidParameter("tool_choice 'required' or a named function cannot be combined with another "
                                   "structured output constraint", param="tool_choice")
        constraint, param = plan.constraint, "tools"
    span = reasoning_span(reasoning, tokenizer, request.thinking_token_budget)
    if constraint is not None and span is not None:  # the constraint starts where the reasoning ends
        constraint = dataclasses.replace(constraint, reasoning=span)
    elif span is not None and span.budget is not None:  # the budget alone: a gate with a free answer
        constraint, param = StructuredOutputsParams(reasoning=span), "thinking_token_budget"
    # fields the request leaves unset: the model's defaults, under serve's sampling flags
    params = serving.sampling_params(request, prompt_ids, structured_outputs=constraint).with_defaults(
        serving.engine.sampling_defaults)
    if plan is not None and plan.parses_calls and serving.tool_parser.needs_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    if reasoning is not None and reasoning.parser.needs_special_tokens(tokenizer):
        params = dataclasses.replace(params, skip_special_tokens=False)
    return request, PreparedChat(PreparedPrompt(prompt_ids, params), plan, constraint, param, reasoning)


def template_variables(serving: ServingEngine, request: ChatCompletionRequest) -> dict:
    """The variables the model's chat template gets beside the messages (chat_template_kwargs, reasoning_effort)."""
    template = getattr(serving.engine.tokenizer, "chat_template", None)
    return request.template_variables(template.source if template is not None else None)


def reasoning_split(parser: ReasoningParser | None, prompt: str) -> ReasoningSplit | None:
    """How the reply to `prompt` splits (None without a parser)."""
    return ReasoningSplit(parser, parser.opening(prompt)) if parser is not None else None


def reasoning_span(reasoning: ReasoningSplit | None, tokenizer, budget: int | None) -> ReasoningSpan | None:
    """The reasoning the reply's constraint lets through, capped at `budget` tokens (thinking_token_budget).
    A budget on a model without a reasoning parser, or whose template closed the reasoning, has nothing
    to cap."""
    if reasoning is None:
        return None
    try:
        return reasoning.grammar_span(tokenizer, budget)
    except ValueError as err:
        raise InvalidParameter(str(err), param="thinking_token_budget") from None


def chat_usage(outputs: list[RequestOutput], reasoning: ReasoningSplit | None, tokenizer) -> dict:
    """The request's usage; with a reasoning parser also OpenAI's `completion_tokens_details.reasoning_tokens`
    (left out when the markers are not single tokens to count)."""
    counted = usage(outputs)
    if reasoning is not None:
        counts = [reasoning.num_reasoning_tokens(c.text, c.token_ids, tokenizer) for o in outputs for c in o.outputs]
        if None not in counts:
            counted["completion_tokens_details"] = {"reasoning_tokens": sum(counts)}
    return counted


async def create_chat_completion(serving: ServingEngine, request: ChatCompletionRequest, prepared: PreparedChat,
                                 raw_request: Request):
    await serving.compile_constraint(prepared.constraint, prepared.constraint_param)
    plan, parser, reasoning = prepared.plan, serving.tool_parser, prepared.reasoning
    with_reasoning = serving.reasoning_parser is not None  # the field is there whenever a parser is
    parses_calls = plan is not None and plan.parses_calls
    request_id = new_request_id("chatcmpl")
    streams = await serving.submit([prepared.prompt], request_id, request.tenant, is_small_body(raw_request))
    num_top = request.top_logprobs or 0
    created = int(time.time())

    def logprobs_of(entries) -> dict | None:
        return chat_logprobs(entries, num_top, serving.token_text) if request.logprobs else None

    def message_of(completion: CompletionOutput) -> tuple[dict, str | None]:
        """The choice's message and finish_reason, with its tool calls parsed out."""
        thinking, text = reasoning.split(completion.text) if reasoning is not None else (None, completion.text)
        message = {"role": "assistant", "content": text}
        if with_reasoning:
            message["reasoning_content"] = thinking
        if not parses_calls:
            return message, completion.finish_reason
        content, calls = parser.extract(text, plan.parallel, plan.tools)
        if not calls:
            return message, completion.finish_reason
        message.update(content=content, tool_calls=[call.as_openai() for call in calls])
        return message, "tool_calls" if completion.finish_reason == "stop" else completion.finish_reason

    if not request.stream:
        (output,) = await final_outputs(serving, streams, raw_request)
        check_finished([output])
        choices = []
        for c in output.outputs:
            message, finish_reason = message_of(c)
            choices.append({"index": c.index, "message": message, "logprobs": logprobs_of(c.logprobs or []),
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        return JSONResponse({
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": serving.model_name,
            "choices": choices,
            "usage": chat_usage([output], reasoning, serving.engine.tokenizer),
            "system_fingerprint": None,
            # vLLM's: the rendered prompt's logprobs, beside the choices (a stream cannot ask: protocol.py)
            **({} if request.prompt_logprobs is None else {"prompt_logprobs": vllm_prompt_logprobs(
                output.prompt_logprobs, request.prompt_logprobs, serving.token_text)}),
        })

    usage_field = {"usage": None} if request.include_usage else {}
    sent_role: set[int] = set()
    call_streams: dict[int, ToolCallStream] = {}  # per choice index, when the reply's calls are parsed
    reasoning_streams: dict[int, ReasoningStream] = {}  # per choice index, with a reasoning parser

    def chunk(choice: dict) -> dict:
        return {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": serving.model_name, "system_fingerprint": None, "choices": [choice], **usage_field}

    def choice_delta(completion: CompletionOutput) -> dict | None:
        content, tool_calls, thinking = completion.delta_text, [], ""
        finish_reason = completion.finish_reason
        if reasoning is not None:
            split = reasoning_streams.setdefault(completion.index, reasoning.stream())
            thinking, content = split.feed(content, final=finish_reason is not None)
        if parses_calls:
            calls = call_streams.setdefault(completion.index, ToolCallStream(parser, plan.parallel, plan.tools))
            content, tool_calls = calls.feed(content, final=finish_reason is not None)
            if calls.num_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        has_news = content or thinking or tool_calls or completion.delta_logprobs or finish_reason
        if completion.index in sent_role and not has_news:
            return None
        delta = {"content": content if content or not (tool_calls or thinking) else None}
        if with_reasoning:
            delta["reasoning_content"] = thinking or None
        if tool_calls:
            delta["tool_calls"] = tool_calls
        if completion.index not in sent_role:
            delta["role"] = "assistant"
            sent_role.add(completion.index)
        logprobs = logprobs_of(completion.delta_logprobs or []) if completion.delta_logprobs else None
        choice = {"index": completion.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return choice | ({"stop_reason": completion.stop_reason} if finish_reason is not None else {})

    # Without reasoning or tool calls to parse, a running choice's chunk (its role sent, no logprobs) is this
    # template around its index and content.
    slot = SSETemplate.slot
    template = SSETemplate(chunk({
        "index": slot(0), "delta": {"content": slot(1), **({"reasoning_content": None} if with_reasoning else {})},
        "logprobs": None, "finish_reason": None}), 2) if reasoning is None and not parses_calls else None

    def chunk_of(completion: CompletionOutput) -> dict | str | None:
        if (template is not None and completion.finish_reason is None and completion.index in sent_role
                and not completion.delta_logprobs):
            return template.render(completion.index, completion.delta_text) if completion.delta_text else None
        choice = choice_delta(completion)
        return None if choice is None else chunk(choice)

    def chunks_of(_: int, output: RequestOutput) -> list[dict | str]:
        chunks = (chunk_of(c) for c in output.outputs)
        return [c for c in chunks if c is not None]

    def final_chunks(outputs: list[RequestOutput]) -> list[dict]:
        if not request.include_usage:
            return []
        return [{"id": request_id, "object": "chat.completion.chunk", "created": created,
                 "model": serving.model_name, "system_fingerprint": None, "choices": [],
                 "usage": chat_usage(outputs, reasoning, serving.engine.tokenizer)}]

    return EventStreamResponse(stream_events(serving, streams, chunks_of, final_chunks),
                               on_close=lambda: serving.release(streams))
