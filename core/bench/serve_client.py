"""One streamed request to an OpenAI-compatible server, and the record of what came back when.

The request asks for `stream: true` with `stream_options.include_usage`, so a server that follows
OpenAI sends the token counts in a last chunk; the benchmark counts tokens itself only where that
is missing. Server-sent events are parsed as the WHATWG spec says (lines end in \\n, \\r\\n or \\r;
`data:` lines of one event are joined with \\n; an empty line ends the event; `:` lines are
comments; an event cut off by the end of the stream is dropped), on raw bytes, so a line of any
length parses and the arrival time of each event is the time its last byte came.

Every way a request can go wrong ends the request with an error kind instead of hanging or
raising: an HTTP error status (its number: "429", "503"), "stall" (no byte for `stall_timeout_s`),
"timeout" (the whole request past `request_timeout_s`), "closed" (the connection ended mid-stream),
"incomplete" (the stream ended cleanly but without `data: [DONE]`), "malformed" (an event that is
not JSON, or not a completion chunk), "stream-error" (an error object sent in the stream, or a
finish reason of error or abort) and "connect" (no connection).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_LINE_END = re.compile(rb"\r\n|\r|\n")
MAX_SSE_LINE_BYTES = 16 * 2**20  # a server that never ends a line cannot make the client hold more


class MalformedStream(Exception):
    """The response body is not a stream of completion chunks."""


@dataclass(frozen=True)
class RequestSettings:
    """How every request of a run is sent."""

    endpoint: str = "completions"  # a key of ENDPOINTS
    temperature: float = 0.0
    ignore_eos: bool = True  # vLLM / SGLang / llama.cpp / deepinfer extension: run to max_tokens
    extra_body: dict = field(default_factory=dict)  # merged into every request body
    request_timeout_s: float = 600.0
    stall_timeout_s: float = 60.0

    def timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=self.stall_timeout_s,
                                     sock_read=self.stall_timeout_s)


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are time.perf_counter() seconds."""

    index: int
    prompt_len: int  # the prompt's tokens by the benchmark's tokenizer
    requested_output_len: int
    sent_s: float = 0.0
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each chunk that carried output text
    text: str = ""
    status: int | None = None
    error_kind: str | None = None
    error: str | None = None
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    done_s: float | None = None  # when [DONE] (or the error) came

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.sent_s if self.chunk_times_s else None

    @property
    def e2e_s(self) -> float | None:
        return None if self.done_s is None else self.done_s - self.sent_s

    def fail(self, kind: str, message: str) -> None:
        if self.error_kind is None:
            self.error_kind, self.error = kind, message


def request_body(settings: RequestSettings, model: str, prompt: str, max_tokens: int) -> dict:
    body: dict = {"model": model, "max_tokens": max_tokens, "stream": True,
                  "stream_options": {"include_usage": True}, "temperature": settings.temperature}
    if settings.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if settings.ignore_eos:
        body["ignore_eos"] = True
    body.update(settings.extra_body)
    return body


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The data of each complete server-sent event in a byte stream."""
    pending = b""
    skip_lf = False  # the bytes so far ended in \r: a \n first in the next ones ends no second line
    data: list[str] = []
    async for chunk in chunks:
        buffer = pending + chunk
        if skip_lf and buffer.startswith(b"\n"):
            buffer = buffer[1:]
        *lines, pending = _LINE_END.split(buffer)
        skip_lf = not pending and buffer.endswith(b"\r")
        if len(pending) > MAX_SSE_LINE_BYTES:
            raise MalformedStream(f"a line of the event stream is longer than {MAX_SSE_LINE_BYTES} bytes")
        for raw in lines:
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise MalformedStream(f"the event stream is not UTF-8: {err}") from None
            if not line:
                if data:
                    yield "\n".join(data)
                    data = []
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            if name == "data":
                data.append(value.removeprefix(" "))
            # event, id and retry carry nothing a completion stream needs


def _chunk_text(chunk: dict, endpoint: str) -> tuple[str, str | None]:
    """(output text, finish reason) of one completion chunk."""
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        raise MalformedStream(f"a chunk without a choices list: {json.dumps(chunk)[:200]}")
    text, finish = "", None
    for choice in choices:
        if not isinstance(choice, dict):
            raise MalformedStream(f"a choice that is not an object: {json.dumps(chunk)[:200]}")
        if endpoint == "chat":
            delta = choice.get("delta") or {}
            # reasoning models stream their thinking apart from the answer; both are generated tokens
            piece = (delta.get("reasoning_content") or "") + (delta.get("content") or "")
        else:
            piece = choice.get("text") or ""
        if not isinstance(piece, str):
            raise MalformedStream(f"a chunk whose text is not a string: {json.dumps(chunk)[:200]}")
        text += piece
        finish = choice.get("finish_reason") or finish
    return text, finish


async def stream_request(session: aiohttp.ClientSession, base_url: str, model: str, settings: RequestSettings,
                         record: RequestRecord, prompt: str, headers: dict | None = None) -> RequestRecord:
    """Send one request and fill `record` as its stream arrives; never raises for what the server does."""
    url = base_url.rstrip("/") + ENDPOINTS[settings.endpoint]
    body = request_body(settings, model, prompt, record.requested_output_len)
    record.sent_s = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers, timeout=settings.timeout()) as response:
            record.status = response.status
            if response.status != 200:
                detail = (await response.text(errors="replace"))[:300]
                record.fail(str(response.status), f"HTTP {response.status}: {detail}")
                return record
            await _read_stream(response, settings.endpoint, record)
    except aiohttp.ServerTimeoutError as err:  # sock_read / sock_connect: the server went quiet
        record.fail("stall", f"no data for {settings.stall_timeout_s:g} s ({err or type(err).__name__})")
    except asyncio.TimeoutError:
        record.fail("timeout", f"the request took longer than {settings.request_timeout_s:g} s")
    except aiohttp.ClientConnectorError as err:
        record.fail("connect", str(err))
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, ConnectionError) as err:
        record.fail("closed", f"the connection ended mid-stream: {err or type(err).__name__}")
    except MalformedStream as err:
        record.fail("malformed", str(err))
    except aiohttp.ClientError as err:
        record.fail("client", f"{type(err).__name__}: {err}")
    finally:
        record.done_s = time.perf_counter()
    return record


async def _read_stream(response: aiohttp.ClientResponse, endpoint: str, record: RequestRecord) -> None:
    finished = False
    async for data in sse_events(response.content.iter_any()):
        received = time.perf_counter()
        if data.strip() == "[DONE]":
            finished = True
            break
        try:
            chunk = json.loads(data)
        except ValueError:
            raise MalformedStream(f"an event that is not JSON: {data[:200]!r}") from None
        if not isinstance(chunk, dict):
            raise MalformedStream(f"an event that is not a JSON object: {data[:200]!r}")
        if "error" in chunk:
            error = chunk["error"]
            message = error.get("message") if isinstance(error, dict) else error
            record.fail("stream-error", f"the server sent an error mid-stream: {message}")
            continue
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            record.usage_prompt_tokens = _count(usage.get("prompt_tokens"))
            record.usage_completion_tokens = _count(usage.get("completion_tokens"))
        text, finish = _chunk_text(chunk, endpoint)
        if text:
            record.chunk_times_s.append(received)
            record.text += text
        if finish in ("error", "abort"):
            record.fail("stream-error", f"the server ended the request with finish_reason {finish!r}")
    if not finished:
        record.fail("incomplete", "the stream ended without data: [DONE]")


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


async def list_models(session: aiohttp.ClientSession, base_url: str, headers: dict | None = None,
                      timeout_s: float = 30.0) -> dict:
    """The server's GET /v1/models answer (raises aiohttp.ClientError or ValueError when there is none)."""
    async with session.get(base_url.rstrip("/") + "/v1/models", headers=headers,
                           timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
        if response.status != 200:
            raise ValueError(f"GET /v1/models answered HTTP {response.status}: "
                             f"{(await response.text(errors='replace'))[:200]}")
        answer = await response.json(content_type=None)
    if not isinstance(answer, dict) or not isinstance(answer.get("data"), list):
        # a wrong answer from the server, caught with the other ValueErrors above
        raise ValueError(f"GET /v1/models did not answer a model list: {str(answer)[:200]}")  # noqa: TRY004
    return answer
