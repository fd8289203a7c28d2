"""Plain ASGI middleware for what comes before any parsing: API key, body size, HEAD, error counts.

Plain ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses and the client-disconnect
signal pass through untouched: the disconnect is what aborts a streaming request.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.exceptions import HTTPException

from deepinfer.core.server.errors import error_bytes

OPEN_PATHS = ("/health", "/metrics")  # probes and scrapers never need the API key


async def send_error(send, status: int, message: str, code: str, headers: list[tuple[bytes, bytes]] = (),
                     path: str | None = None) -> None:
    body = error_bytes(status, message, code=code, path=path)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def bearer_token(authorization: bytes) -> bytes | None:
    """The credentials of 'Bearer <token>'; the scheme is case-insensitive (RFC 7235)."""
    scheme, _, token = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip()


class ApiKeyMiddleware:
    """With an API key set, every route but /health and /metrics needs `Authorization: Bearer <key>`
    (the OpenAI routes, /tokenize, /detokenize and the OpenAPI schema), sent once: two Authorization
    headers are a 400, whatever they hold. Without an Authorization header, `x-api-key: <key>` (what
    Anthropic's clients send) is read instead."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        authorizations = [value for name, value in scope["headers"] if name == b"authorization"]
        api_keys = [value for name, value in scope["headers"] if name == b"x-api-key"]
        if len(authorizations) > 1 or (not authorizations and len(api_keys) > 1):  # a proxy may have checked one
            header = "Authorization" if authorizations else "x-api-key"
            await send_error(send, 400, f"the request has {max(len(authorizations), len(api_keys))} {header} "
                             f"headers; send one", code="duplicate_authorization", path=path)
            return
        given = bearer_token(authorizations[0]) if authorizations else (api_keys[0].strip() if api_keys else None)
        if given is None or not hmac.compare_digest(given, self._expected):
            await send_error(send, 401, "missing or invalid API key: send 'Authorization: Bearer <key>' "
                             "(or 'x-api-key: <key>')", code="invalid_api_key", headers=[(b"www-authenticate", b"Bearer")], path=path)
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Answers 413 for a body over `max_bytes`: at once from Content-Length, or while reading a chunked body
    (raised as an HTTPException from receive(), which the body reader lets through to the 413 handler)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes
        self.message = f"request body is larger than this server's limit of {max_bytes} bytes"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await send_error(send, 413, self.message, code="body_too_large", path=scope["path"])
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, detail=self.message)
            return message

        await self.app(scope, limited_receive, send)


class HeadAsGetMiddleware:
    """HEAD is answered wherever GET is: routed as GET; the server drops the body (it knows the method)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "HEAD":
            scope = dict(scope, method="GET")
        await self.app(scope, receive, send)


class ErrorCountMiddleware:
    """Counts every answer with an error status (`count(status)`), whoever produced it: a handler,
    another middleware, a 404 from the router. 499 (the client left first) is not an answer."""

    def __init__(self, app, count: Callable[[int], None]):
        self.app = app
        self._count = count

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400 and message["status"] != 499:
                self._count(message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
