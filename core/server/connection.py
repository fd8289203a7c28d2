"""Bounds on connections that uvicorn leaves open or lets through: slow, idle and stalled clients,
too many sockets, request heads that proxies in front could read differently.

uvicorn (h11) closes a kept-alive connection that stays idle after a response (`timeout_keep_alive`),
but it sets no time limit on a request being received or on a response being read: a socket that
sends nothing, half a request line, headers without their end, headers without the body they
announce, or that stops reading a stream is held forever, and enough of them exhaust the file
descriptors. `limit_concurrency` only answers 503 once a request has arrived, so idle sockets are
not counted against it. GuardedH11Protocol adds these bounds:

- a deadline for each request: its line, headers and body must all arrive within
  `request_timeout_s` of the connection opening, or of the previous response on a kept-alive
  connection. When it passes, a client that sent part of a request gets a 408; one that sent
  nothing is just closed. The app's handler, if it was waiting for the body, sees a disconnect.
  The request is in once h11 has its end: "done" on a kept-alive connection, "must close" for
  HTTP/1.0 and `Connection: close`; generating the answer is not limited here.
- a deadline for writing: a response of which the client takes nothing for
  `stream_write_timeout_s` (the transport stays above its high-water mark, so every send waits, and
  its buffer does not shrink) is cut: the connection is dropped, the handler sees a disconnect and a
  stream is aborted, freeing its sequence. A slow reader that takes some bytes in each period is not.
- a cap on open connections: the connection beyond `max_connections` gets a 503 and is closed at
  once, so the cap holds file descriptors too, not only requests.
- a strict request head, checked on the bytes before h11 reads them (h11 is lenient where a proxy
  may not be): at most MAX_HEAD_BYTES (431 past it, however the bytes were segmented; h11 only
  caps a head still incomplete), every line ended by CRLF (a bare LF is a 400), and not both
  Transfer-Encoding and Content-Length (a 400, RFC 9112 section 6.1: the framing is ambiguous).
  Each refusal closes the connection.
- a lingering close: a connection closed while its client is still sending the request body (a 413
  answered from Content-Length, a 408 mid-body) is half-closed and what still arrives is discarded
  until the client closes or the request deadline passes. Closing at once would make the kernel
  reset the connection over the unread bytes, and the client would see the reset, not the answer.

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

MAX_HEAD_BYTES = 16 * 1024  # the request line and headers, their final CRLF CRLF included
# h11 has the whole request (nothing more will be read for it) in these states of the client.
_REQUEST_IN = (h11.DONE, h11.MUST_CLOSE)


def _raw_error_response(status: int, reason: str, message: str, code: str, extra: bytes = b"") -> bytes:
    body = error_bytes(status, message, code=code)
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n").encode() + extra + b"\r\n" + body


class RequestRefused(Exception):
    """A request head this server does not read: `response` is the whole answer to send before closing."""

    def __init__(self, status: int, response: bytes):
        super().__init__(status)
        self.status, self.response = status, response


HEAD_TOO_LARGE = RequestRefused(431, _raw_error_response(
    431, "Request Header Fields Too Large",
    f"the request line and headers are larger than this server's limit of {MAX_HEAD_BYTES} bytes",
    "headers_too_large"))
BARE_LF = RequestRefused(400, _raw_error_response(
    400, "Bad Request", "a line of the request head ends in a bare LF; HTTP/1.1 lines end in CRLF", "malformed_request"))
AMBIGUOUS_FRAMING = RequestRefused(400, _raw_error_response(
    400, "Bad Request", "the request has both Transfer-Encoding and Content-Length; send one", "malformed_request"))


def check_head(received: bytes, max_head_bytes: int = MAX_HEAD_BYTES) -> None:
    """Raise RequestRefused unless `received` (what has arrived of a request, from its first byte) starts
    with an acceptable head, or the start of one: at most `max_head_bytes`, no bare LF."""
    end = received.find(b"\r\n\r\n")
    head = received if end < 0 else received[:end + 4]
    if len(head) > max_head_bytes:
        raise HEAD_TOO_LARGE
    if head.count(b"\n") != head.count(b"\r\n"):
        raise BARE_LF


class StrictConnection(h11.Connection):
    """h11's server connection with the head checks: the bytes of a request head are checked before h11
    parses them (while the client is IDLE, `trailing_data` starts at its request), its headers after."""

    def __init__(self, max_head_bytes: int = MAX_HEAD_BYTES):
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes

    def next_event(self):
        if self.their_state is h11.IDLE:
            check_head(self.trailing_data[0], self.max_head_bytes)
        event = super().next_event()
        if isinstance(event, h11.Request):
            names = {name.lower() for name, _ in event.headers}
            if b"transfer-encoding" in names and b"content-length" in names:
                raise AMBIGUOUS_FRAMING
        return event


class _LingeringTransport:
    """The transport as uvicorn sees it: `close()` lingers (see the module docstring) while the client
    is still sending its request body, and a second `close()` (the server shutting down) closes;
    everything else is the real transport's (`raw`)."""

    def __init__(self, transport: asyncio.Transport, protocol: H11Protocol):
        self.raw = transport
        self._protocol = protocol
        self.lingering = False

    def __getattr__(self, name: str):
        return getattr(self.raw, name)

    def is_closing(self) -> bool:
        return self.lingering or self.raw.is_closing()

    def close(self) -> None:
        if not self.lingering and self._protocol.conn.their_state is h11.SEND_BODY and self.raw.can_write_eof():
            self.lingering = True
            self.raw.resume_reading()
            self.raw.write_eof()  # a FIN after the answer: the client reads it, then closes
            self._protocol.linger()
        else:
            self.raw.close()


def guarded_protocol(request_timeout_s: float, max_connections: int,
                     on_refused: Callable[[int], None] = lambda status: None,
                     stream_write_timeout_s: float = 60.0,
                     max_head_bytes: int = MAX_HEAD_BYTES) -> type[H11Protocol]:
    """An H11Protocol class with the bounds above; `on_refused(status)` counts each 408, 503, 431 and 400
    it answers itself."""
    over_capacity = _raw_error_response(
        503, "Service Unavailable", f"this server holds at most {max_connections} connections; retry later",
        "too_many_connections", b"retry-after: 1\r\n")
    timed_out = _raw_error_response(
        408, "Request Timeout", f"the request did not arrive in full within {request_timeout_s:g} seconds",
        "request_timeout")

    class GuardedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _write_deadline: asyncio.TimerHandle | None = None
        _unsent_at_arm = 0  # bytes in the write buffer when the write deadline was armed
        _bytes_since_armed = 0

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.conn = StrictConnection(max_head_bytes)

        def connection_made(self, transport) -> None:
            super().connection_made(_LingeringTransport(transport, self))
            if len(self.connections) > max_connections:
                transport.write(over_capacity)
                transport.close()
                on_refused(503)
                return
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            self._stop_write_deadline()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.transport.lingering:
                return  # the rest of a request already answered: discarded
            self._bytes_since_armed += len(data)
            super().data_received(data)
            if self.conn.their_state in _REQUEST_IN:  # the request is in: the handler's time is not limited here
                self._disarm()

        def handle_events(self) -> None:
            try:
                super().handle_events()
            except RequestRefused as refused:
                self._disarm()
                self.transport.write(refused.response)
                on_refused(refused.status)
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state not in _REQUEST_IN:
                self._arm()  # waiting for the next request (or the rest of this one's unread body)

        def linger(self) -> None:
            """The transport half-closed with the request body still coming: close it at the request
            deadline (or when the client closes first)."""
            self._disarm()
            self._deadline = self.loop.call_later(request_timeout_s, self.transport.raw.close)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_deadline is None:
                self._arm_write_deadline()

        def _arm_write_deadline(self) -> None:
            # While writing is paused every send waits, so the buffer only shrinks as the client reads.
            self._unsent_at_arm = self.transport.get_write_buffer_size()
            self._write_deadline = self.loop.call_later(stream_write_timeout_s, self._on_write_deadline)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._stop_write_deadline()

        def _stop_write_deadline(self) -> None:
            if self._write_deadline is not None:
                self._write_deadline.cancel()
                self._write_deadline = None

        def _on_write_deadline(self) -> None:
            self._write_deadline = None
            if self.transport.get_write_buffer_size() < self._unsent_at_arm:
                self._arm_write_deadline()  # a slow reader, not a stalled one: it took some bytes meanwhile
                return
            cycle = self.cycle
            logger.warning("%s has read nothing of its response for %g s: closing the connection%s",
                           f"{self.client[0]}:{self.client[1]}" if self.client else "a client", stream_write_timeout_s,
                           "" if cycle is None or cycle.response_complete else " and aborting its request")
            self.transport.raw.abort()  # drops the unsent bytes; connection_lost tells the handler

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
