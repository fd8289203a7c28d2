"""What both OpenAI endpoints share: the model check, prompt limits, submitting to the engine,
and following a request to its end while watching for the client going away.

Every check here runs before the engine sees the request, so a bad request never takes a slot
in the waiting queue. The checks that cost time (tokenization, the prompt limits) run on the
preprocessing threads (preprocess.py), making the engine requests on a worker thread (`submit`);
only the following of streams runs on the event loop. A request whose client disconnects is aborted (its blocks come back within one engine
step): the streaming generator's `finally` and the non-streaming watcher both abort it. At
shutdown, `end_all` aborts every request still running; each then ends with finish_reason
"abort" as a client-side abort would.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from json.encoder import encode_basestring as _json_string  # json.dumps(str, ensure_ascii=False)

from starlette.requests import Request
from starlette.responses import StreamingResponse

from deepinfer.core.engine.frontend.outputs import RequestOutput
from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.errors import DeepInferError, InvalidRequestError
from deepinfer.core.reasoning import make_reasoning_parser
from deepinfer.core.server.config import ServerConfig
from deepinfer.core.server.errors import APIError, InvalidParameter, engine_error_to_api, error_body
from deepinfer.core.server.logprobs import TokenStrings
from deepinfer.core.structured.params import StructuredOutputsParams
from deepinfer.core.structured.tool_parsers import make_tool_parser
from deepinfer.core.structured.tools import ToolPlan

# Requests of at most this many samples (and no grammar) are added to the engine on the event loop.
INLINE_SAMPLES = 4
# Normalizers may merge characters (NFC composes up to 3 code points into one): a tokenizer with
# one gets this much slack in the characters-per-token bound.
NORMALIZER_SLACK = 4


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# Code points that str.splitlines() (and clients built on it, such as httpx's aiter_lines) takes for
# line ends although SSE ends lines only at CR / LF; JSON leaves them raw inside strings unless escaped.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(payload: dict) -> str:
    """`payload` as one line of JSON for an event's `data:`, UTF-8 kept, whatever text it holds."""
    return json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS_JSON_KEEPS)


def sse(payload: dict | str) -> str:
    """One server-sent event as OpenAI streams them: `data: <json>` and a blank line."""
    data = payload if isinstance(payload, str) else sse_json(payload)
    return f"data: {data}\n\n"


class SSETemplate:
    """The `data:` line (`sse_json`) of one chunk shape whose only changing values are a few strings, ints or
    None (a stream's text delta and choice index): the JSON around them is rendered once, and each chunk
    joins it with its values' JSON, the same characters `sse_json` gives for the whole payload.

    `payload` holds a marker string (`slot(i)`) where value i goes."""

    def __init__(self, payload: dict, num_slots: int) -> None:
        text = sse_json(payload)
        self._parts: list[str] = []
        for i in range(num_slots):
            head, _, text = text.partition(json.dumps(self.slot(i), ensure_ascii=False))
            self._parts.append(head)
        self._parts.append(text)

    @staticmethod
    def slot(i: int) -> str:
        return f"\ue000slot{i}\ue000"  # private-use characters: JSON keeps them as they are

    def render(self, *values: str | int | None) -> str:
        parts = self._parts
        out = [parts[0]]
        for value, part in zip(values, parts[1:]):
            if value is None:
                out.append("null")
            elif isinstance(value, str):
                out.append(_json_string(value).translate(_LINE_BREAKS_JSON_KEEPS))
            else:
                out.append(str(value))  # an int
            out.append(part)
        return "".join(out)


def usage(outputs: list[RequestOutput]) -> dict:
    """OpenAI's usage of one API request: every prompt's tokens once, every choice's tokens."""
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    completion_tokens = sum(len(c.token_ids) for output in outputs for c in output.outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(output.num_cached_tokens for output in outputs)},
    }


def chars_per_token_bound(tokenizer) -> int | None:
    """The most characters one token of `tokenizer` can stand for (None: unknown, no bound).

    A text of C characters then has at least C / bound tokens, so a text longer than
    max_prompt_tokens * bound characters is too long without tokenizing it. Byte-level and
    SentencePiece vocabularies spell each token with at least as many characters as it covers.
    """
    hf_tokenizer = getattr(tokenizer, "hf_tokenizer", None)
    if hf_tokenizer is None:
        return 1 if type(tokenizer).__name__ == "ByteTokenizer" else None  # one token per UTF-8 byte
    try:
        longest = max(len(token) for token in hf_tokenizer.get_vocab())
        normalizer = hf_tokenizer.backend_tokenizer.normalizer
    except Exception:  # noqa: BLE001 -- a tokenizer without these parts just gets no bound
        return None
    return longest * (NORMALIZER_SLACK if normalizer is not None else 1)


@dataclass
class PreparedPrompt:
    """One prompt of a request, ready for the engine."""

    token_ids: list[int]
    params: SamplingParams
    text: str | None = None  # the prompt as text, when the response echoes it


class ServingEngine:
    """The loaded engine as the HTTP handlers see it: its served name and the limits on a request."""

    def __init__(self, engine, server_config: ServerConfig, chars_per_token: int | None = None):
        self.engine = engine
        self.model_name = server_config.served_model_name or engine.model_name
        self.max_model_len = engine.max_model_len
        self.max_prompt_tokens = min(server_config.max_prompt_tokens or self.max_model_len, self.max_model_len)
        self.max_prompt_chars = None if chars_per_token is None else self.max_prompt_tokens * chars_per_token
        self.max_num_seqs = engine.config.max_num_seqs
        self.max_waiting_requests = engine.config.max_waiting_requests
        self.vocab_size = engine.spec.vocab_size
        self.token_text = TokenStrings(engine.tokenizer)
        self.tool_parser = make_tool_parser(server_config.tool_call_parser, engine.tokenizer)
        self.reasoning_parser = make_reasoning_parser(server_config.reasoning_parser, engine.tokenizer)
        self.created = int(time.time())
        self._live: set = set()  # RequestStreams submitted and not yet followed to their end

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise APIError(404, f"The model {requested!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    # Preprocessing (worker threads) ------------------------------------------------------------

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

    def _too_long(self, num_tokens: int | str) -> APIError:
        return APIError(400, f"The prompt has {num_tokens} tokens; this server accepts at most "
                             f"{self.max_prompt_tokens} prompt tokens.", code="context_length_exceeded")

    def tokenize(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids, refusing a text too long to fit before tokenizing it."""
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise self._too_long(f"at least {len(text) * self.max_prompt_tokens // self.max_prompt_chars}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:  # JSON "\ud800": a lone surrogate the tokenizer cannot take
            raise InvalidParameter(f"{param} is not valid Unicode text: {err.reason} at position {err.start}",
                                   param=param) from None
        return list(self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_token_ids(self, token_ids: list[int], param: str) -> list[int]:
        if len(token_ids) > self.max_prompt_tokens:
            raise self._too_long(len(token_ids))
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidParameter(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param=param)
        return list(token_ids)

    def sampling_params(self, request, prompt_ids: list[int], num_prompts: int = 1,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """Check the prompt against --max-prompt-tokens and prompt + max_tokens against the context."""
        num_prompt = len(prompt_ids)
        if num_prompt == 0:
            raise InvalidParameter("the prompt is empty after tokenization", param="prompt")
        if num_prompt > self.max_prompt_tokens:
            raise self._too_long(num_prompt)
        bad_stop = next((t for t in request.stop_token_ids or [] if not 0 <= t < self.vocab_size), None)
        if bad_stop is not None:
            raise InvalidParameter(f"stop token id {bad_stop} is outside the vocabulary [0, {self.vocab_size})",
                                   param="stop_token_ids")
        if request.n > self.max_num_seqs:
            raise InvalidParameter(f"n={request.n} exceeds this server's max_num_seqs={self.max_num_seqs}",
                                   param="n")
        if request.n * num_prompts > self.max_waiting_requests:
            raise InvalidParameter(f"{num_prompts} prompts x n={request.n} sequences exceed this server's "
                                   f"max_waiting_requests={self.max_waiting_requests}", param="prompt")
        requested = request.requested_max_tokens
        max_tokens = requested if requested is not None else self.max_model_len - num_prompt
        if requested == 0:  # completions' echo without generation (protocol.py): one token is made, then dropped
            max_tokens = 1
        if max_tokens < 1 or num_prompt + max_tokens > self.max_model_len:
            raise APIError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                     f"{num_prompt + max(max_tokens, 0)} tokens ({num_prompt} in the prompt, {max(max_tokens, 0)} "
                     f"for the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens", code="context_length_exceeded")
        return request.to_sampling_params(max_tokens, request.token_biases(self.vocab_size), structured_outputs)

    # The event loop ----------------------------------------------------------------------------

    async def submit(self, prompts: list[PreparedPrompt], request_id: str, tenant: str | None,
                     small_body: bool) -> list:
        """One engine request per prompt; all or none (a refusal aborts the ones already queued).

        Making a request checks its lists against the vocabulary and sets up each of its n samples
        (generator, grammar matcher, token lists). A request of a small body (`small_body`: its lists are
        short too) with at most INLINE_SAMPLES samples and no grammar is added here, on the event loop:
        its setup costs less than handing it to a worker thread and back, two waits for the GIL in a
        process busy streaming. Any other runs on a worker thread, so one n=128 request or a prompt with
        the longest stop strings does not stall the other clients' streams and /health."""
        if (small_body and sum(prompt.params.n for prompt in prompts) <= INLINE_SAMPLES
                and all(prompt.params.structured_outputs is None for prompt in prompts)):
            streams = self._add_requests(prompts, request_id, tenant)
            self._live.update(streams)
            return streams
        future = asyncio.get_running_loop().run_in_executor(None, self._add_requests, prompts, request_id, tenant)
        try:
            streams = await asyncio.shield(future)
        except asyncio.CancelledError:  # the handler is gone: whatever the thread queues is aborted
            future.add_done_callback(_abort_added)
            raise
        self._live.update(streams)
        return streams

    def _add_requests(self, prompts: list[PreparedPrompt], request_id: str, tenant: str | None) -> list:
        """`submit`'s work, on a worker thread (AsyncEngine.add_request is thread-safe)."""
        streams = []
        try:
            for index, prompt in enumerate(prompts):
                engine_id = request_id if len(prompts) == 1 else f"{request_id}-{index}"
                streams.append(self.engine.add_request(prompt.token_ids, prompt.params, request_id=engine_id,
                                                       cache_salt=tenant))
        except DeepInferError as err:
            for stream in streams:
                stream.abort()
            raise engine_error_to_api(err) from None
        return streams

    def release(self, streams: list) -> None:
        """The handler is done with `streams`: abort what is still running, forget them."""
        for stream in streams:
            stream.abort()
        self._live.difference_update(streams)

    @property
    def num_running(self) -> int:
        """API requests' engine requests submitted and not yet followed to their end."""
        return len(self._live)

    def end_all(self) -> int:
        """Abort every request still running (shutdown); each ends with finish_reason "abort"."""
        for stream in list(self._live):
            stream.abort()
        return len(self._live)


def _abort_added(future: asyncio.Future) -> None:
    """Aborts the streams a cancelled `submit` queued after all."""
    if not future.cancelled() and future.exception() is None:
        for stream in future.result():
            stream.abort()


async def outputs_of(streams: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from every stream, as they come, until all have finished.

    One read per stream is outstanding at a time, and the next starts only once its output was
    handled: while the consumer waits (a client that stops reading), each stream's new outputs
    merge inside the stream instead of piling up here."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    reads = {asyncio.ensure_future(anext(stream)): index for index, stream in enumerate(streams)}
    try:
        while reads:
            done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
            for read in sorted(done, key=reads.__getitem__):
                index = reads.pop(read)
                output = read.result()  # a DeepInferError (the engine refused it or died) ends them all
                yield index, output
                if not output.finished:
                    reads[asyncio.ensure_future(anext(streams[index]))] = index
    finally:
        for read in reads:
            read.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def final_outputs(serving: ServingEngine, streams: list, request: Request) -> list[RequestOutput]:
    """Follow a non-streaming request to its end (one output per prompt); abort it if the client leaves."""

    async def consume() -> list[RequestOutput]:
        last: list = [None] * len(streams)
        async for index, output in outputs_of(streams):
            last[index] = output
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
        consumer.cancel()
        serving.release(streams)


def check_finished(outputs: list[RequestOutput]) -> None:
    """A request that failed inside the engine (finish_reason "error") is the server's fault: a 500."""
    for output in outputs:
        if output.error is not None or any(c.finish_reason == "error" for c in output.outputs):
            raise APIError(500, f"the request failed in the engine: {output.error or 'unknown error'}",
                           code="engine_error")


class EventStreamResponse(StreamingResponse):
    """SSE response that closes its event generator however the response ends. Starlette cancels the
    sending task when the client disconnects but leaves the generator suspended; closing it here runs
    its `finally` (the abort) now rather than whenever the generator is garbage-collected."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close  # also when the generator never started (the client left at once)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.on_close()


async def stream_events(serving: ServingEngine, streams: list,
                        chunks_of: Callable[[int, RequestOutput], list[dict | str]],
                        final_chunks: Callable[[list[RequestOutput]], list[dict]]) -> AsyncIterator[str]:
    """SSE events for one API request: `chunks_of(prompt index, output)` per engine output (each a payload,
    or its JSON already made), `final_chunks(last outputs)` at the end, then `data: [DONE]`. The events of
    one output are one write; the last output's, the final chunks and [DONE] are one too. Cancellation (the
    client went away) or any error aborts the request's engine requests."""
    last: list = [None] * len(streams)
    ending = ""  # the last output's events, sent with the end
    try:
        try:
            if len(streams) == 1:
                async for output in streams[0]:
                    last[0] = output
                    events = "".join([sse(chunk) for chunk in chunks_of(0, output)])
                    if output.finished:
                        ending = events
                    elif events:
                        yield events
            else:
                num_finished = 0
                async for index, output in outputs_of(streams):
                    last[index] = output
                    events = "".join([sse(chunk) for chunk in chunks_of(index, output)])
                    num_finished += output.finished
                    if num_finished == len(streams):
                        ending = events
                    elif events:
                        yield events
        except DeepInferError as err:  # the engine died mid-stream: the status line is sent, so say it in-band
            api_error = engine_error_to_api(err)
            yield sse(error_body(api_error.status, api_error.message, code=api_error.code)) + sse("[DONE]")
            return
        failed = next((o for o in last if o is not None and (
            o.error is not None or any(c.finish_reason == "error" for c in o.outputs))), None)
        if failed is not None:
            ending += sse(error_body(500, f"the request failed in the engine: {failed.error or 'unknown error'}",
                                     code="engine_error"))
        elif all(o is not None for o in last):
            ending += "".join([sse(chunk) for chunk in final_chunks(last)])
        yield ending + sse("[DONE]")
    finally:
        serving.release(streams)
