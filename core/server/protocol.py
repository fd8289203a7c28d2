"""OpenAI request bodies as pydantic models, and their translation to SamplingParams.

Fields follow OpenAI's reference for /v1/chat/completions and /v1/completions, plus vLLM's
sampling extras (top_k, min_p, repetition_penalty, ignore_eos, cache_salt, add_special_tokens)
and vLLM's /tokenize and /detokenize bodies. Unknown fields are ignored as OpenAI's own server
does; fields that would change the answer in a way deepinfer cannot honour are listed in
unsupported.py and rejected with a 400 before these models see the body.

Types are strict, so "abc" for a number is a 400, not a guess, and NaN or Infinity (which
Python's JSON reader accepts) never reach the sampler. An integer field takes an integral float
(`"n": 46.0`), which JSON Schema counts as an integer.
"""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.server.errors import InvalidParameter

MAX_N = 128  # samples per request; each holds its own KV blocks after the shared prompt
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16  # each is checked against the new text after every token, on the engine thread
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias: [-100, 100]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds become torch generator seeds (int64)


def _integral_float_to_int(value):
    """46.0 -> 46 (JSON Schema's integers include integral floats); anything else is left to the int check."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral_float_to_int)]
StopStrings = Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)]
_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = _STRICT
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _SamplingFields(BaseModel):
    """Fields both endpoints share."""

    model_config = _STRICT

    model: str | None = None
    n: Int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: str | StopStrings | None = None
    seed: Int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias added to its logit
    # vLLM-style extras
    top_k: Int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    cache_salt: str | None = None
    stop_token_ids: list[Int] | None = None
    skip_special_tokens: bool = True

    @property
    def tenant(self) -> str | None:
        """The prefix-cache tenant: requests only share cached blocks with the same salt."""
        return self.cache_salt if self.cache_salt is not None else self.user

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidParameter("stream_options is only allowed when stream is true", param="stream_options")

    def token_biases(self, vocab_size: int) -> dict[int, float] | None:
        """logit_bias with its keys read as token ids of this vocabulary (400 for anything else)."""
        if not self.logit_bias:
            return None
        biases = {}
        for key, bias in self.logit_bias.items():
            token_id = int(key) if key.isascii() and key.isdigit() else -1
            if not 0 <= token_id < vocab_size:
                raise InvalidParameter(f"logit_bias key {key!r} is not a token id in [0, {vocab_size})",
                                       param="logit_bias")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidParameter(f"logit_bias[{key!r}] = {bias} is outside [-100, 100]", param="logit_bias")
            biases[token_id] = bias
        return biases

    def _sampling_params(self, max_tokens: int, logprobs: int | None,
                         logit_bias: dict[int, float] | None) -> SamplingParams:
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
                logit_bias=logit_bias,
            )
        except ValueError as err:
            raise InvalidParameter(str(err)) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template writes BOS and the other special tokens as text

    def check(self) -> None:
        """Reject what pydantic's field checks cannot see (400s, before the engine sees anything)."""
        self._check_common()
        if not self.messages:
            raise InvalidParameter("messages must contain at least one message", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameter("top_logprobs requires logprobs to be true", param="top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int, logit_bias: dict[int, float] | None) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, logit_bias)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = Field(16, ge=1)  # OpenAI's legacy default
    logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: Int | None = Field(None, ge=1)
    add_special_tokens: bool = True

    def check(self) -> None:
        self._check_common()
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidParameter("best_of other than n is not supported", param="best_of")
        if self.echo and self.logprobs is not None:
            raise InvalidParameter("echo with logprobs is not supported (it needs the prompt's log-probabilities)",
                                   param="echo")

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each a string or token ids; a single prompt is a batch of one."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise InvalidParameter("prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            return [prompt]
        for index, item in enumerate(prompt):
            if len(item) == 0:
                raise InvalidParameter(f"prompt[{index}] must not be empty", param="prompt")
        return list(prompt)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(self, max_tokens: int, logit_bias: dict[int, float] | None) -> SamplingParams:
        return self._sampling_params(max_tokens, self.logprobs, logit_bias)


class TokenizeCompletionRequest(BaseModel):
    """vLLM's /tokenize body for a text prompt."""

    model_config = _STRICT
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """vLLM's /tokenize body for chat messages (rendered with the model's template, then tokenized)."""

    model_config = _STRICT
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[Int]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every non-200 answer: OpenAI's error shape."""

    error: ErrorDetail
