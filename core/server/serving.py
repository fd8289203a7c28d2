"""What both OpenAI endpoints share: the model check, prompt limits, submitting to the engine,
and following a request to its end while watching for the client going away.

Every check here runs before the engine sees the request, so a bad request never takes a slot
in the waiting queue. A request whose client disconnects is aborted (its blocks come back within
one engine step): the streaming generator's `finally` and the non-streaming watcher both call
`stream.abort()`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import StreamingResponse

from deepinfer.core.engine.outputs import RequestOutput
from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.errors import DeepInferError, InvalidRequestError
from deepinfer.core.server.config import ServerConfig
from deepinfer.core.server.errors import APIError, InvalidParameter, engine_error_to_api, error_body
from deepinfer.core.server.logprobs import TokenStrings
from deepinfer.core.structured.params import StructuredOutputsParams
from deepinfer.core.structured.tool_parsers import make_tool_parser
from deepinfer.core.structured.tools import ToolPlan


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: dict | str) -> str:
    """One server-sent event as OpenAI streams them: `data: <json>` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def usage(output: RequestOutput) -> dict:
    prompt_tokens = len(output.prompt_token_ids)
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
    }


class ServingEngine:
    """The loaded engine as the HTTP handlers see it: its served name and the limits on a request."""

    def __init__(self, engine, server_config: ServerConfig):
        self.engine = engine
        self.model_name = server_config.served_model_name or engine.model_name
        self.max_model_len = engine.max_model_len
        self.max_prompt_tokens = min(server_config.max_prompt_tokens or self.max_model_len, self.max_model_len)
        self.max_num_seqs = engine.config.max_num_seqs
        self.vocab_size = engine.spec.vocab_size
        self.token_text = TokenStrings(engine.tokenizer)
        self.tool_parser = make_tool_parser(server_config.tool_call_parser, engine.tokenizer)
        self.created = int(time.time())

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise APIError(404, f"The model {requested!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def tokenize(self, prompt: str | list[int], param: str, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as err:  # JSON "\ud800": a lone surrogate the tokenizer cannot take
                raise InvalidParameter(f"{param} is not valid Unicode text: {err.reason} at position {err.start}",
                                       param=param) from None
            return list(self.engine.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidParameter(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param=param)
        return list(prompt)

    def tool_plan(self, request) -> ToolPlan | None:
        """The chat request's tools and tool_choice, checked; None when it has neither."""
        if not request.tools and request.tool_choice is None:
            return None
        try:
            return ToolPlan.make(request.tools, request.tool_choice, request.parallel_tool_calls, self.tool_parser)
        except (ValueError, TypeError) as err:
            param = "tool_choice" if "tool_choice" in str(err) else "tools"
            raise InvalidParameter(str(err), param=param) from None

    async def compile_constraint(self, constraint: StructuredOutputsParams | None, param: str) -> None:
        """Compile the grammar off the event loop, within the compile timeout, so that adding the
        request finds it in the cache. A constraint the grammar engine refuses is a 400."""
        if constraint is None:
            return
        try:
            await self.engine.grammars.compile_with_timeout(constraint)
        except InvalidRequestError as err:  # GrammarError, or a vocabulary llguidance cannot read
            raise InvalidParameter(str(err), param=param) from None

    def sampling_params(self, request, prompt_ids: list[int],
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """Check the prompt against --max-prompt-tokens and prompt + max_tokens against the context."""
        num_prompt = len(prompt_ids)
        if num_prompt == 0:
            raise InvalidParameter("the prompt is empty after tokenization", param="prompt")
        if num_prompt > self.max_prompt_tokens:
            raise APIError(400, f"The prompt has {num_prompt} tokens; this server accepts at most "
                                f"{self.max_prompt_tokens} prompt tokens.", code="context_length_exceeded")
        bad_stop = next((t for t in request.stop_token_ids or [] if not 0 <= t < self.vocab_size), None)
        if bad_stop is not None:
            raise InvalidParameter(f"stop token id {bad_stop} is outside the vocabulary [0, {self.vocab_size})",
                                   param="stop_token_ids")
        if request.n > self.max_num_seqs:
            raise InvalidParameter(f"n={request.n} exceeds this server's max_num_seqs={self.max_num_seqs}",
                                   param="n")
        requested = request.requested_max_tokens
        max_tokens = requested if requested is not None else self.max_model_len - num_prompt
        if max_tokens < 1 or num_prompt + max_tokens > self.max_model_len:
            raise APIError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                     f"{num_prompt + max(max_tokens, 0)} tokens ({num_prompt} in the prompt, {max(max_tokens, 0)} "
                     f"for the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens", code="context_length_exceeded")
        return request.to_sampling_params(max_tokens, structured_outputs)

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str, tenant: str | None):
        try:
            return self.engine.add_request(prompt_ids, params, request_id=request_id, cache_salt=tenant)
        except DeepInferError as err:
            raise engine_error_to_api(err) from None


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def final_output(stream, request: Request) -> RequestOutput:
    """Follow a non-streaming request to its end; abort it if the client leaves first."""

    async def consume() -> RequestOutput:
        last = None
        async for output in stream:
            last = output
        return last

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if consumer.done():
            try:
                return consumer.result()
            except DeepInferError as err:  # refused inside the engine thread (a full queue raced us), or it died
                raise engine_error_to_api(err) from None
        raise APIError(499, "client disconnected")
    finally:
        watcher.cancel()
        if not consumer.done():
            consumer.cancel()
            stream.abort()


def check_finished(output: RequestOutput) -> None:
    """A request that failed inside the engine (finish_reason "error") is the server's fault: a 500."""
    if output.error is not None or any(c.finish_reason == "error" for c in output.outputs):
        raise APIError(500, f"the request failed in the engine: {output.error or 'unknown error'}",
                       code="engine_error")


class EventStreamResponse(StreamingResponse):
    """SSE response that closes its event generator however the response ends. Starlette cancels the
    sending task when the client disconnects but leaves the generator suspended; closing it here runs
    its `finally` (the abort) now rather than whenever the generator is garbage-collected."""

    def __init__(self, events: AsyncIterator[str]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def stream_events(stream, chunks_of: Callable[[RequestOutput], list[dict]],
                        final_chunks: Callable[[RequestOutput], list[dict]]) -> AsyncIterator[str]:
    """SSE events for one request: `chunks_of(output)` per engine output, `final_chunks(last)` at the end,
    then `data: [DONE]`. Cancellation (the client went away) or any error aborts the request."""
    finished = False
    try:
        last = None
        try:
            async for output in stream:
                last = output
                for chunk in chunks_of(output):
                    yield sse(chunk)
        except DeepInferError as err:  # the engine died mid-stream: the status line is sent, so say it in-band
            api_error = engine_error_to_api(err)
            yield sse(error_body(api_error.status, api_error.message, code=api_error.code))
            yield sse("[DONE]")
            return
        finished = True
        if last is not None and (last.error is not None or any(c.finish_reason == "error" for c in last.outputs)):
            yield sse(error_body(500, f"the request failed in the engine: {last.error or 'unknown error'}",
                                 code="engine_error"))
        elif last is not None:
            for chunk in final_chunks(last):
                yield sse(chunk)
        yield sse("[DONE]")
    finally:
        if not finished:
            stream.abort()
