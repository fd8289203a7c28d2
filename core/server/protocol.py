"""OpenAI request bodies as pydantic models, and their translation to SamplingParams.

Fields follow OpenAI's reference for /v1/chat/completions and /v1/completions, plus vLLM's
sampling extras (top_k, min_p, repetition_penalty, ignore_eos, cache_salt). Unknown fields are
ignored as OpenAI's own server does; fields that would change the answer in a way deepinfer
cannot honour (tools, response_format, logit_bias, echo, suffix) are rejected with a 400
instead of being silently dropped.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.server.errors import InvalidParameter

MAX_N = 128  # samples per request; each holds its own KV blocks after the shared prompt
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16  # each is checked against the new text after every token, on the engine thread
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds become torch generator seeds (int64)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _SamplingFields(BaseModel):
    """Fields both endpoints share; strict on types, so "abc" for a number is a 400, not a guess,
    and NaN or Infinity (which Python's JSON reader accepts) never reach the sampler."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: str | list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM-style extras
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    cache_salt: str | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    @property
    def tenant(self) -> str | None:
        """The prefix-cache tenant: requests only share cached blocks with the same salt."""
        return self.cache_salt if self.cache_salt is not None else self.user

    def _check_common(self) -> None:
        if self.logit_bias:
            raise InvalidParameter("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise InvalidParameter("stream_options is only allowed when stream is true", param="stream_options")

    def _sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                n=self.n,
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                seed=self.seed,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
            )
        except ValueError as err:
            raise InvalidParameter(str(err)) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        """Reject what pydantic's field checks cannot see (400s, before the engine sees anything)."""
        self._check_common()
        if not self.messages:
            raise InvalidParameter("messages must contain at least one message", param="messages")
        if self.tools:
            raise InvalidParameter("tools are not supported", param="tools")
        if self.tool_choice not in (None, "none"):
            raise InvalidParameter("tool_choice is not supported", param="tool_choice")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise InvalidParameter("only response_format type 'text' is supported", param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameter("top_logprobs requires logprobs to be true", param="top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's legacy default
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def check(self) -> None:
        self._check_common()
        if self.echo:
            raise InvalidParameter("echo is not supported", param="echo")
        if self.suffix:
            raise InvalidParameter("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidParameter("best_of other than n is not supported", param="best_of")

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request: a string or token ids (a one-element batch is unwrapped)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidParameter("send one prompt per request (batched prompts are not supported)",
                                       param="prompt")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise InvalidParameter("prompt must not be empty", param="prompt")
        return prompt

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        return self._sampling_params(max_tokens, self.logprobs)

