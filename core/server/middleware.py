"""Plain ASGI middleware for the checks that come before any parsing: API key and body size.

Plain ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses and the client-disconnect
signal pass through untouched: the disconnect is what aborts a streaming request.
"""

from __future__ import annotations

import hmac

from starlette.exceptions import HTTPException

from deepinfer.core.server.errors import error_bytes


async def send_error(send, status: int, message: str, code: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = error_bytes(status, message, code=code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class ApiKeyMiddleware:
    """With an API key set, every /v1/ route needs `Authorization: Bearer <key>`; /health and /metrics stay open."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self._expected):
            await send_error(send, 401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key", headers=[(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Answers 413 for a body over `max_bytes`: at once from Content-Length, or while reading a chunked body
    (raised as an HTTPException from receive(), which FastAPI's body reader lets through to the 413 handler)."""

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
            await send_error(send, 413, self.message, code="body_too_large")
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
