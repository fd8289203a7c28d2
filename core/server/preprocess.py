"""Request preparation off the event loop: JSON parsing, validation, chat templating, tokenization.

The event loop only reads a request's bytes (bounded by --max-body-bytes) and hands them to a
small pool of worker threads, so one client's 2 MiB prompt or slow chat template never stalls
another client's stream or /health. The pool is small on purpose: the tokenizer releases the GIL,
but JSON parsing and templating hold it, and every extra busy thread is one more the loop waits
behind. At most `max_pending` requests are being read or prepared at once; beyond that a request
gets a 429 at once (before its body is read), so a flood of large bodies cannot pile up in memory.

A completion's small body (at most INLINE_BODY_BYTES: a prompt of a few hundred tokens) is prepared on
the event loop itself: parsing and tokenizing it take less time than the hand-over to a worker thread
and back, which in a process busy streaming costs two waits for the GIL, and they are part of every
request's time to first token. A chat request is not: its template is the model's code, whose time
the body does not bound.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from deepinfer.core.server.errors import APIError, ClientGone, InvalidParameter, validation_message
from deepinfer.core.server.unsupported import reject_unsupported

INLINE_BODY_BYTES = 4096
Model = TypeVar("Model", bound=BaseModel)
T = TypeVar("T")


class Preprocessor:
    def __init__(self, workers: int, max_pending: int):
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="deepinfer-preprocess")
        self._pending = 0
        self.max_pending = max_pending

    @contextmanager
    def slot(self):
        """Hold one of the `max_pending` places while a request is read and prepared (429 when none is free)."""
        if self._pending >= self.max_pending:
            raise APIError(429, f"the server is preparing {self._pending} requests already; retry later",
                           code="server_busy")
        self._pending += 1
        try:
            yield
        finally:
            self._pending -= 1

    async def run(self, fn: Callable[[object, bytes], T], serving, body: bytes, bounded: bool = False) -> T:
        """`fn(serving, body)` on a worker thread; on the event loop instead when `bounded` (its cost is bounded
        by the body's size: no chat template to render) and the body is at most INLINE_BODY_BYTES."""
        if bounded and len(body) <= INLINE_BODY_BYTES:
            return fn(serving, body)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, serving, body)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def is_small_body(request: Request) -> bool:
    """Whether the request's body (read by `read_json_bytes`) was at most INLINE_BODY_BYTES: such a request
    also carries too little (stop strings, logit bias, token lists) for its engine setup to be costly."""
    return request.state.body_bytes <= INLINE_BODY_BYTES


def check_json_content_type(request: Request) -> None:
    """POST bodies are JSON; say so when the client sent something else (curl -d sends a form)."""
    content_type = request.headers.get("content-type")
    if content_type is None:
        raise APIError(415, "the request has no Content-Type header; send 'Content-Type: application/json'",
                       code="unsupported_media_type")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not (media_type.startswith("application/")
                                                 and media_type.endswith("+json")):
        raise APIError(415, f"Content-Type must be application/json, got {content_type!r}",
                       code="unsupported_media_type")


async def read_json_bytes(request: Request) -> bytes:
    """The body's bytes (the body-limit middleware stops it at --max-body-bytes)."""
    check_json_content_type(request)
    try:
        return await request.body()
    except ClientDisconnect:
        raise ClientGone from None


def parse_json_object(body: bytes) -> dict:
    """JSON bytes -> the request's object, or a 400 that says what is wrong. Worker threads only."""
    if not body.strip():
        raise InvalidParameter("the request body must be a JSON object")
    try:
        payload = json.loads(body)
    except RecursionError:
        raise InvalidParameter("the request body is nested too deeply") from None
    except ValueError as err:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
        raise InvalidParameter(f"request body is not valid JSON: {err}") from None
    if not isinstance(payload, dict):
        raise InvalidParameter("the request body must be a JSON object")
    return payload


def validate(payload: dict, model: type[Model]) -> Model:
    try:
        return model.model_validate(payload)
    except ValidationError as err:
        message, param = validation_message(err.errors())
        raise InvalidParameter(message, param=param) from None
    except RecursionError:
        raise InvalidParameter("the request body is nested too deeply") from None


def parse_body(body: bytes, model: type[Model], endpoint: str | None = None) -> Model:
    """JSON bytes -> a validated request model; fields this server lacks (unsupported.py) are a 400."""
    payload = parse_json_object(body)
    if endpoint is not None:
        reject_unsupported(payload, endpoint)
    return validate(payload, model)
