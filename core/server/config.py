"""ServerConfig: the HTTP side's knobs (the engine's are in core.config.EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 2 * 1024**2  # a 2 MiB JSON body holds a prompt far beyond any context length


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless the operator says otherwise
    port: int = 8000
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    served_model_name: str | None = None  # the name clients pass as "model"; None = the engine's model name
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_tokens: int | None = None  # None = the context length
    tool_call_parser: str | None = None  # hermes | llama3_json | mistral; None = detected from the chat template

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}"),
            (self.max_body_bytes >= 1024, f"max_body_bytes must be >= 1024, got {self.max_body_bytes}"),
            (self.max_prompt_tokens is None or self.max_prompt_tokens >= 1,
             f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}"),
            (self.api_key is None or self.api_key != "", "api_key must not be empty"),
            (self.tool_call_parser in (None, "hermes", "llama3_json", "mistral"),
             f"tool_call_parser must be hermes, llama3_json or mistral, got {self.tool_call_parser!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
