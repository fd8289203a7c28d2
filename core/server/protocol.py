"""OpenAI request bodies as pydantic models, and their translation to SamplingParams.

Fields follow OpenAI's reference for /v1/chat/completions and /v1/completions, plus vLLM's
sampling extras (top_k, min_p, repetition_penalty, ignore_eos, cache_salt, add_special_tokens)
and vLLM's /tokenize and /detokenize bodies. Unknown fields are ignored as OpenAI's own server
does; fields that would change the answer in a way deepinfer cannot honour are listed in
unsupported.py and rejected with a 400 before these models see the body.

Structured outputs (docs/STRUCTURED_OUTPUTS.md), one source per request: OpenAI's
`response_format` (json_object, json_schema), vLLM's `structured_outputs` and its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, llama.cpp's `grammar`.
Tools: `tools`, `tool_choice`, `parallel_tool_calls`; messages may carry `tool_calls` and `tool` turns.

Types are strict, so "abc" for a number is a 400, not a guess, and NaN or Infinity (which
Python's JSON reader accepts) never reach the sampler. An integer field takes an integral float
(`"n": 46.0`), which JSON Schema counts as an integer.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from deepinfer.core.engine.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_TOKEN_IDS, SamplingParams
from deepinfer.core.server.errors import InvalidParameter
from deepinfer.core.structured.params import StructuredOutputsParams

MAX_N = 128  # samples per request; each holds its own KV blocks after the shared prompt
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16  # each is checked against the new text after every token, on the engine thread
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias: [-100, 100]
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
# Template variables a request sets through its own fields, never through chat_template_kwargs.
RESERVED_TEMPLATE_VARIABLES = frozenset(("messages", "tools", "documents", "add_generation_prompt"))
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds become torch generator seeds (int64)


def _integral_float_to_int(value):
    """46.0 -> 46 (JSON Schema's integers include integral floats); anything else is left to the int check."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral_float_to_int)]
StopString = Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]
StopStrings = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
StopTokenIds = Annotated[list[Int], Field(max_length=MAX_STOP_TOKEN_IDS)]
_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = _STRICT
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str = ""


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn's answer to this call
    reasoning_content: str | None = None  # an assistant turn's reasoning, for templates that show it again


# vLLM's structured_outputs options that change nothing here (one grammar engine, its own defaults).
_IGNORED_STRUCTURED_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                               "whitespace_pattern")


class _SamplingFields(BaseModel):
    """Fields both endpoints share."""

    model_config = _STRICT

    model: str | None = None
    n: Int = Field(1, ge=1, le=MAX_N)
    # None (absent): the model's default (generation_config.json, GGUF metadata), or serve's flag
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)  # None: the model's default (0 unless it sets one)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stop: str | StopStrings | None = None
    seed: Int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias added to its logit
    # vLLM-style extras
    top_k: Int | None = Field(None, ge=-1)  # None as temperature's
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    cache_salt: str | None = None
    stop_token_ids: StopTokenIds | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM's: top alternatives per prompt token
    # Structured outputs (one source at most)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted for vLLM clients; there is one engine
    grammar: str | None = None  # llama.cpp's GBNF

    @property
    def tenant(self) -> str | None:
        """The prefix-cache tenant: requests only share cached blocks with the same salt."""
        return self.cache_salt if self.cache_salt is not None else self.user

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidParameter("stream_options is only allowed when stream is true", param="stream_options")
        if self.stream and self.prompt_logprobs is not None:
            raise InvalidParameter("prompt_logprobs is not available when stream is true", param="prompt_logprobs")
        if isinstance(self.stop, str) and len(self.stop) > MAX_STOP_STRING_CHARS:
            raise InvalidParameter(f"stop: String should have at most {MAX_STOP_STRING_CHARS} characters",
                                   param="stop")

    def _structured_sources(self) -> dict[str, dict]:
        """{request field: StructuredOutputsParams fields} for each constraint the request sets."""
        sources = {}
        if self.response_format is not None:
            constraint = _response_format_constraint(self.response_format)
            if constraint is not None:
                sources["response_format"] = constraint
        if self.structured_outputs is not None:
            options = {k: v for k, v in self.structured_outputs.items() if k not in _IGNORED_STRUCTURED_OPTIONS}
            sources["structured_outputs"] = options
        legacy = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar", "grammar": "grammar"}
        for field_name, kind in legacy.items():
            value = getattr(self, field_name)
            if value is not None:
                sources[field_name] = {kind: value}
        return sources

    def structured_outputs_param(self) -> str | None:
        """The field an error about the request's constraint names: `structured_outputs.regex` for
        vLLM's object with one kind, else the request field (`response_format`, `guided_json`, ...)."""
        sources = self._structured_sources()
        if not sources:
            return None
        param, fields = next(iter(sources.items()))
        if param == "structured_outputs" and len(fields) == 1 and isinstance(self.structured_outputs, dict):
            return f"structured_outputs.{next(iter(fields))}"
        return param

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one structured-output constraint the request asks for, or None. Raises InvalidParameter."""
        sources = self._structured_sources()
        if not sources:
            return None
        if len(sources) > 1:
            raise InvalidParameter(f"give one structured output constraint, got {', '.join(sources)}",
                                   param=next(iter(sources)))
        param = self.structured_outputs_param()
        try:
            return StructuredOutputsParams.coerce(next(iter(sources.values())))
        except (ValueError, TypeError) as err:
            raise InvalidParameter(f"{param}: {err}", param=param) from None

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

    def _sampling_params(self, max_tokens: int, logprobs: int | None, logit_bias: dict[int, float] | None,
                         structured_outputs: StructuredOutputsParams | None = None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        """The request's params; the sampling fields it does not set stay None (the caller fills them
        with the engine's SamplingDefaults)."""
        try:
            return SamplingParams(
                n=self.n,
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
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
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                logit_bias=logit_bias,
                structured_outputs=structured_outputs,
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
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_special_tokens: bool = False  # the template writes BOS and the other special tokens as text
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template (enable_thinking)
    reasoning_effort: str | None = None  # given to templates that read it
    thinking_token_budget: Int | None = Field(None, ge=0)  # vLLM's cap on the reasoning's tokens

    def check(self) -> None:
        """Reject what pydantic's field checks cannot see (400s, before the engine sees anything)."""
        self._check_common()
        if not self.messages:
            raise InvalidParameter("messages must contain at least one message", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameter("top_logprobs requires logprobs to be true", param="top_logprobs")
        reserved = sorted(set(self.chat_template_kwargs or {}) & RESERVED_TEMPLATE_VARIABLES)
        if reserved:
            raise InvalidParameter(f"chat_template_kwargs may not set {', '.join(reserved)} (the request's own "
                                   f"fields do)", param="chat_template_kwargs")
        if self.reasoning_effort is not None and self.reasoning_effort not in REASONING_EFFORTS:
            raise InvalidParameter(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got "
                                   f"{self.reasoning_effort!r}", param="reasoning_effort")

    def template_variables(self, template_source: str | None) -> dict[str, Any]:
        """chat_template_kwargs and reasoning_effort, as the chat template receives them. A
        reasoning_effort the template never reads would be dropped silently: a 400 instead."""
        variables = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            if "reasoning_effort" not in (template_source or ""):
                raise InvalidParameter("reasoning_effort: this model's chat template does not use a reasoning "
                                       "effort", param="reasoning_effort")
            variables["reasoning_effort"] = self.reasoning_effort
        return variables

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: int, logit_bias: dict[int, float] | None = None,
                           structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, logit_bias, structured_outputs, self.prompt_logprobs)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = Field(16, ge=0)  # OpenAI's legacy default; 0 only with echo (the prompt alone)
    logprobs: Int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False  # the choice starts with the prompt; with logprobs, so do its logprobs (the first null)
    best_of: Int | None = Field(None, ge=1)
    add_special_tokens: bool = True

    def check(self) -> None:
        self._check_common()
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidParameter("best_of other than n is not supported", param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidParameter("max_tokens 0 asks for no completion: it is only allowed with echo",
                                   param="max_tokens")

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

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt and its logprobs (vLLM's); one token is made and dropped."""
        return self.echo and self.max_tokens == 0

    @property
    def echo_logprobs(self) -> bool:
        """Whether the choices' logprobs start with the prompt's (echo with logprobs)."""
        return self.echo and self.logprobs is not None

    def to_sampling_params(self, max_tokens: int, logit_bias: dict[int, float] | None = None,
                           structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        # The engine scores the prompt once, for the larger of what echo's logprobs and prompt_logprobs show.
        wanted = [k for k in (self.logprobs if self.echo_logprobs else None, self.prompt_logprobs) if k is not None]
        return self._sampling_params(max_tokens, self.logprobs, logit_bias, structured_outputs,
                                     max(wanted) if wanted else None)


def _response_format_constraint(response_format: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's response_format -> StructuredOutputsParams fields (None for plain text)."""
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise InvalidParameter("response_format json_schema needs json_schema.schema, a JSON Schema object",
                                   param="response_format")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidParameter("response_format json_schema.strict must be a boolean", param="response_format")
        return {"json": spec["schema"], "strict": bool(strict)}
    raise InvalidParameter(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                           param="response_format")


class _UtilityRequest(BaseModel):
    """The bodies of vLLM's /tokenize and /detokenize: strict, with an optional model name."""

    model_config = _STRICT
    model: str | None = None


class TokenizeCompletionRequest(_UtilityRequest):
    """vLLM's /tokenize body for a text prompt."""

    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_UtilityRequest):
    """vLLM's /tokenize body for chat messages (rendered with the model's template, then tokenized)."""

    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_UtilityRequest):
    tokens: list[Int]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every non-200 answer: OpenAI's error shape."""

    error: ErrorDetail
