"""Bounds on connections that uvicorn leaves open: slow and idle clients, too many sockets.

uvicorn (h11) closes a kept-alive connection that stays idle after a response (`timeout_keep_alive`)
and caps header size (h11's 16 KiB), but it sets no time limit on a request being received: a
socket that sends nothing, half a request line, headers without their end, or headers without
the body they announce is held forever, and enough of them exhaust the file descriptors.
`limit_concurrency` only answers 503 once a request has arrived, so idle sockets are not counted
against it. GuardedH11Protocol adds both bounds:

- a deadline for each request: its line, headers and body must all arrive within
  `request_timeout_s` of the connection opening, or of the previous response on a kept-alive
  connection. When it passes, a client that sent part of a request gets a 408; one that sent
  nothing is just closed. The app's handler, if it was waiting for the body, sees a disconnect.
- a cap on open connections: the connection beyond `max_connections` gets a 503 and is closed at
  once, so the cap holds file descriptors too, not only requests.

When the process does run out of descriptors anyway, asyncio logs a 5-line traceback for every
accept it retries (thousands a second); `AcceptErrorLog` reports those once per interval instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from deepinfer.core.server.errors import error_bytes

logger = logging.getLogger("deepinfer.server")


def _raw_error_response(status: int, reason: str, message: str, code: str, extra: bytes = b"") -> bytes:
    body = error_bytes(status, message, code=code)
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n").encode() + extra + b"\r\n" + body


def guarded_protocol(request_timeout_s: float, max_connections: int,
                     on_refused: Callable[[int], None] = lambda status: None) -> type[H11Protocol]:
    """An H11Protocol class with the two bounds above; `on_refused(status)` counts each 408 and 503."""
    over_capacity = _raw_error_response(
        503, "Service Unavailable", f"this server holds at most {max_connections} connections; retry later",
        "too_many_connections", b"retry-after: 1\r\n")
    timed_out = _raw_error_response(
        408, "Request Timeout", f"the request did not arrive in full within {request_timeout_s:g} seconds",
        "request_timeout")

    class GuardedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _bytes_since_armed = 0

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(over_capacity)
                transport.close()
                on_refused(503)
                return
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            self._bytes_since_armed += len(data)
            super().data_received(data)
            if self.conn.their_state is h11.DONE:  # the request is in: the handler's time is not limited here
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is not h11.DONE:
                self._arm()  # waiting for the next request (or the rest of this one's unread body)

        def _arm(self) -> None:
            self._disarm()
            self._bytes_since_armed = 0
            self._deadline = self.loop.call_later(request_timeout_s, self._on_deadline)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _on_deadline(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            cycle = self.cycle  # the request being received, or the previous one (response complete)
            if self._bytes_since_armed and (cycle is None or cycle.response_complete or not cycle.response_started):
                if cycle is not None and not cycle.response_complete:
                    cycle.disconnected = True  # the handler waiting for the body sees a disconnect; its answer goes nowhere
                self.transport.write(timed_out)
                on_refused(408)
            self.transport.close()

    return GuardedH11Protocol


class AcceptErrorLog:
    """An event-loop exception handler: "socket.accept() out of system resource" (EMFILE and the like)
    is logged once per `interval_s` with how many accepts failed since, everything else as asyncio would."""

    MESSAGE = "socket.accept() out of system resource"

    def __init__(self, interval_s: float = 10.0):
        self.interval_s = interval_s
        self._failed = 0
        self._last_logged = -float("inf")

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if context.get("message") != self.MESSAGE:
            loop.default_exception_handler(context)
            return
        self._failed += 1
        now = time.monotonic()
        if now - self._last_logged >= self.interval_s:
            logger.error("cannot accept connections: %s (%d failed accepts since the last report); "
                         "raise the open-file limit (ulimit -n) or lower --max-connections",
                         context.get("exception"), self._failed)
            self._failed = 0
            self._last_logged = now
