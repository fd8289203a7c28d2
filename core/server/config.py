"""ServerConfig: the HTTP side's knobs (the engine's are in core.config.EngineConfig)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from deepinfer.core.reasoning import NO_PARSER, REASONING_PARSERS
from deepinfer.core.structured.tool_parsers import TOOL_PARSERS

DEFAULT_MAX_BODY_BYTES = 2 * 1024**2  # a 2 MiB JSON body holds a prompt far beyond any context length


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless the operator says otherwise
    port: int = 8000
    api_key: str | None = None  # when set, every route but /health and /metrics needs "Authorization: Bearer <key>"
    served_model_name: str | None = None  # the name clients pass as "model"; None = the engine's model name
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_tokens: int | None = None  # None = the context length
    tool_call_parser: str | None = None  # a TOOL_PARSERS name; None = detected from the chat template
    reasoning_parser: str | None = None  # a REASONING_PARSERS name or "none"; None = detected from the chat template
    allowed_origins: list[str] = field(default_factory=list)  # CORS; empty = no CORS headers at all
    # Slow and idle clients: a request's line, headers and body must all arrive within request_timeout_s
    # of the connection opening (or of the previous response on a kept-alive connection).
    request_timeout_s: float = 30.0
    # A response the client takes nothing of for this long (its socket stays full) is cut: the connection
    # is dropped and a stream's request aborted, freeing its sequence.
    stream_write_timeout_s: float = 60.0
    keep_alive_timeout_s: float = 5.0  # an idle kept-alive connection is closed after this
    max_connections: int = 2048  # open connections beyond this are answered 503 and closed at once
    # SIGTERM/SIGINT: in-flight requests get this long to finish, then are ended (final chunk, [DONE]).
    shutdown_timeout_s: float = 30.0
    # Request parsing, chat templating and tokenization run on these threads, never on the event loop;
    # at most max_pending_requests requests are being read or prepared at once (more get a 429).
    preprocess_workers: int = field(default_factory=lambda: max(1, min(4, os.cpu_count() or 1)))
    max_pending_requests: int = 256
    # The engine core in its own process (core/engine/frontend/core_client.py): HTTP, tokenization and
    # metrics never share a GIL with the step loop. False: the engine runs on a thread of this process.
    engine_process: bool = False
    # API-server processes in front of the one engine-core process (core/server/api_servers.py): each
    # does the HTTP, tokenization and detokenization of the connections it accepts. More than one
    # implies engine_process.
    api_server_count: int = 1
    # Engine replicas, each in its own engine-core process on its own GPU (cuda:i), behind this front end
    # (core/engine/frontend/data_parallel_client.py). More than one implies engine_process.
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.api_server_count > 1 or self.data_parallel_size > 1:
            self.engine_process = True
        checks = [
            (0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}"),
            (self.max_body_bytes >= 1024, f"max_body_bytes must be >= 1024, got {self.max_body_bytes}"),
            (self.max_prompt_tokens is None or self.max_prompt_tokens >= 1,
             f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}"),
            (self.api_key is None or self.api_key != "", "api_key must not be empty"),
            (self.tool_call_parser is None or self.tool_call_parser in TOOL_PARSERS,
             f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got {self.tool_call_parser!r}"),
            (self.reasoning_parser in (None, NO_PARSER, *REASONING_PARSERS),
             f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)} or none, got {self.reasoning_parser!r}"),
            (self.request_timeout_s > 0, f"request_timeout_s must be > 0, got {self.request_timeout_s}"),
            (self.stream_write_timeout_s > 0,
             f"stream_write_timeout_s must be > 0, got {self.stream_write_timeout_s}"),
            (self.keep_alive_timeout_s > 0, f"keep_alive_timeout_s must be > 0, got {self.keep_alive_timeout_s}"),
            (self.max_connections >= 1, f"max_connections must be >= 1, got {self.max_connections}"),
            (self.shutdown_timeout_s >= 0, f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}"),
            (self.preprocess_workers >= 1, f"preprocess_workers must be >= 1, got {self.preprocess_workers}"),
            (self.max_pending_requests >= 1, f"max_pending_requests must be >= 1, got {self.max_pending_requests}"),
            (self.api_server_count >= 1, f"api_server_count must be >= 1, got {self.api_server_count}"),
            (self.data_parallel_size >= 1, f"data_parallel_size must be >= 1, got {self.data_parallel_size}"),
            (self.api_server_count == 1 or self.data_parallel_size == 1,
             "api_server_count and data_parallel_size cannot both be more than 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
