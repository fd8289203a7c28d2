"""SamplingParams: how one request turns logits into tokens and when it stops.

Validated on construction, so a bad value becomes a clear InvalidRequestError (a ValueError) at
the API edge (the server maps it to a 400) and never reaches the engine loop. Types are exact: counts are integers (a bool
is not one, nor is 2.5), rates are real numbers (not bools); ranges are those that survive the
sampler's float32 arithmetic:

- top_p >= the smallest normal float32 (a smaller one rounds to 0 and masks every token);
- repetition_penalty in [0.01, 100] (a logit is divided or multiplied by it: 1e-300 is 0 in
  float32, a division by zero);
- temperature finite and at most float32's maximum;
- seed + n - 1 within what torch.Generator.manual_seed takes, [-2**63, 2**64 - 1] (sample i of
  a request with n > 1 is seeded seed + i);
- stop strings: at most MAX_STOP_STRINGS, each non-empty, at most MAX_STOP_STRING_CHARS long, with
  a UTF-8 form;
- stop_token_ids: at most MAX_STOP_TOKEN_IDS, kept as a frozenset (the scheduler and detokenizer
  look each sampled token up in it);
- logit_bias: a LogitBias, the validated map the sampler turns into one device row per request.

What is validated is kept as a type that says so (StopStrings, StopTokenIds, LogitBias), so the per-sample copies
of a request with n > 1 (`dataclasses.replace(params, seed=...)`) do not validate those lists again:
a request's validation costs one pass over its lists, whatever n is.

Defaults from the model: temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty and
frequency_penalty default to None, "not set". `with_defaults(defaults)` fills the unset ones from a
SamplingDefaults: the model's generation config (generation_config.json, GGUF metadata, a layered checkpoint's copy, or the
values deepinfer ships for its default model), overridden by EngineConfig.override_generation_config
(the `chat` / `serve` sampling flags), as vLLM's `--generation-config auto` does. `LLM`, `chat` and
`serve` fill them so; the engines take params as given, an unset field meaning the built-in value
(BUILTIN_SAMPLING_DEFAULTS: sampling from the model's plain distribution), which is what
benchmarks' fixed sampling gets.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any, Self

from deepinfer.core.engine.frontend.stop_strings import failure_table
from deepinfer.core.errors import InvalidRequestError

FLOAT32_TINY = 1.1754943508222875e-38  # smallest normal float32
FLOAT32_MAX = 3.4028234663852886e38
MIN_REPETITION_PENALTY = 1e-2
MAX_REPETITION_PENALTY = 1e2
MAX_LOGPROBS = 20  # top alternatives per token (vLLM's default max_logprobs)
MAX_STOP_STRINGS = 16  # each is checked against the new text after every token, on the engine thread
MAX_STOP_STRING_CHARS = 4096  # a stop string's characters; as much text can be held back from the stream
MAX_STOP_TOKEN_IDS = 1024  # vocabularies' special tokens number far fewer
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1

from deepinfer.core.structured.params import StructuredOutputsParams

# The fields a model may give defaults for, and the values they take when nothing sets them.
BUILTIN_SAMPLING_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
    "frequency_penalty": 0.0}
MODEL_DEFAULT_FIELDS = tuple(BUILTIN_SAMPLING_DEFAULTS)


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    # None: the model's default (see the module docstring), else BUILTIN_SAMPLING_DEFAULTS.
    temperature: float | None = None  # 0 means greedy
    top_p: float | None = None
    top_k: int | None = None  # 0 or -1 disables
    min_p: float | None = None
    seed: int | None = None
    # OpenAI's: subtracted from the logit of a token once it is in the output / per time it is (never the prompt's)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: tuple[str, ...] = ()  # a string or any list of them is taken; kept as StopStrings
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)  # any collection of ids is taken
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per token; None = no logprobs
    # Top alternatives per prompt token (vLLM's prompt_logprobs); None = none. The first prompt token has none.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # The output must follow this JSON schema, regex, choice or grammar (a dict of its fields works too).
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: Mapping[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI's)

    def __post_init__(self) -> None:
        self.n = _integer("n", self.n, 1)
        self.max_tokens = _integer("max_tokens", self.max_tokens, 1)
        if self.temperature is not None:
            self.temperature = _real("temperature", self.temperature, 0.0, FLOAT32_MAX)
        if self.top_p is not None:
            self.top_p = _real("top_p", self.top_p, FLOAT32_TINY, 1.0)
        if self.top_k is not None:
            self.top_k = _integer("top_k", self.top_k, -1, hint=" (-1 or 0 disables)")
            if self.top_k == -1:
                self.top_k = 0
        if self.min_p is not None:
            self.min_p = _real("min_p", self.min_p, 0.0, 1.0)
        if self.presence_penalty is not None:
            self.presence_penalty = _real("presence_penalty", self.presence_penalty, -2.0, 2.0)
        if self.frequency_penalty is not None:
            self.frequency_penalty = _real("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.repetition_penalty is not None:
            self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY,
                                            MAX_REPETITION_PENALTY)
        if self.seed is not None:
            self.seed = _integer("seed", self.seed, MIN_SEED, MAX_SEED - (self.n - 1),
                                 hint=" (with n samples, seed + n - 1 must fit 64 bits)" if self.n > 1 else "")
        if not isinstance(self.stop, StopStrings):
            self.stop = StopStrings(self.stop)
        if not isinstance(self.stop_token_ids, StopTokenIds):
            self.stop_token_ids = StopTokenIds(self.stop_token_ids)
        self.ignore_eos = _flag("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _flag("skip_special_tokens", self.skip_special_tokens)
        if self.logprobs is not None:
            self.logprobs = _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _integer("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if self.structured_outputs is not None:
            try:
                self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
            except TypeError as err:
                raise InvalidRequestError(str(err)) from None
        if self.logit_bias is not None and not isinstance(self.logit_bias, LogitBias):
            self.logit_bias = LogitBias(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_defaults(self, defaults: SamplingDefaults | None) -> SamplingParams:
        """These params with each unset field (None) taken from `defaults` (None: the built-in values)."""
        unset = [name for name in MODEL_DEFAULT_FIELDS if getattr(self, name) is None]
        if not unset:
            return self
        values = BUILTIN_SAMPLING_DEFAULTS if defaults is None else defaults.values
        filled = copy.copy(self)  # the defaults were checked when they were made: no second validation
        for name in unset:
            setattr(filled, name, values[name])
        return filled

    def resolved(self) -> SamplingParams:
        """These params with every unset field at its built-in value (what the engines sample with)."""
        return self.with_defaults(None)


@dataclass(frozen=True)
class SamplingDefaults:
    """The value each of MODEL_DEFAULT_FIELDS takes when a request leaves it unset, and where it came
    from: "model" (`model_source` names what: generation_config.json, GGUF metadata, ...), "flag"
    (a sampling flag of chat / serve, or EngineConfig.override_generation_config) or "built-in"."""

    values: dict[str, float | int]
    sources: dict[str, str]
    model_source: str | None = None

    @classmethod
    def layer(cls, model: dict[str, float | int] | None = None, model_source: str | None = None,
              flags: dict[str, float | int] | None = None) -> SamplingDefaults:
        """Built-in values, overridden by the model's, overridden by the flags'. Raises InvalidRequestError
        for a value a request could not hold either."""
        values, sources = dict(BUILTIN_SAMPLING_DEFAULTS), dict.fromkeys(MODEL_DEFAULT_FIELDS, "built-in")
        for layer, source in ((model or {}, "model"), (flags or {}, "flag")):
            unknown = sorted(set(layer) - set(MODEL_DEFAULT_FIELDS))
            if unknown:
                raise InvalidRequestError(f"sampling defaults: unknown field {unknown[0]!r}; "
                                          f"known: {', '.join(MODEL_DEFAULT_FIELDS)}")
            checked = SamplingParams(**layer)
            for name in layer:
                values[name], sources[name] = getattr(checked, name), source
        used_model = model_source if "model" in sources.values() else None
        return cls(values, sources, used_model)

    def describe(self) -> str:
        """The values grouped by where they came from, e.g. `temperature 0.2, top_p 0.9 (model:
        generation_config.json); top_k off, min_p 0, repetition_penalty 1 (built-in)`."""
        groups = []
        for source in ("model", "flag", "built-in"):
            names = [name for name in MODEL_DEFAULT_FIELDS if self.sources[name] == source]
            if names:
                values = ", ".join(f"{name} {_value_text(name, self.values[name])}" for name in names)
                label = f"model: {self.model_source}" if source == "model" and self.model_source else source
                groups.append(f"{values} ({label})")
        return "; ".join(groups)


def _value_text(name: str, value: float) -> str:
    return "off" if name == "top_k" and value == 0 else f"{value:g}"


class StopTokenIds(frozenset):
    """A request's stop token ids, validated: at most MAX_STOP_TOKEN_IDS integers >= 0."""

    def __new__(cls, token_ids: Any = ()) -> Self:
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, (list, tuple, set, frozenset)):
            raise InvalidRequestError(f"stop_token_ids must be a list of token ids, got {type(token_ids).__name__}")
        if len(token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"stop_token_ids holds {len(token_ids)} ids, more than the "
                                      f"{MAX_STOP_TOKEN_IDS} allowed")
        return super().__new__(cls, [_integer("stop_token_ids", token, 0) for token in token_ids])


class LogitBias(Mapping):
    """A request's logit_bias, validated and immutable: token id (>= 0) -> bias in [-100, 100].

    `device_rows` is where the sampler keeps the bias as a dense float32 row per (device, logits
    width), built at the request's first sampled step and shared by all its samples.
    """

    __slots__ = ("_biases", "device_rows")

    def __init__(self, biases: Any) -> None:
        if not isinstance(biases, Mapping):
            raise InvalidRequestError(f"logit_bias must map token ids to biases, got {type(biases).__name__}")
        self._biases = {_integer("logit_bias token id", token, 0): _real("logit_bias", bias, -100.0, 100.0)
                        for token, bias in biases.items()}
        self.device_rows: dict = {}

    def __getitem__(self, token_id: int) -> float:
        return self._biases[token_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._biases)

    def __len__(self) -> int:
        return len(self._biases)

    def __repr__(self) -> str:
        return f"LogitBias({_shown(self._biases)})"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _integer(name: str, value: Any, low: int, high: int | None = None, hint: str = "") -> int:
    """An integer (not a bool, not a float) in [low, high]."""
    # Plain ints (what JSON gives) skip the abstract-class check, the costliest part of a long list.
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, Integral)):
        raise InvalidRequestError(f"{name} must be an integer, got {type(value).__name__} {_shown(value)}")
    value = int(value)
    if value < low or (high is not None and value > high):
        interval = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidRequestError(f"{name} must be {interval}{hint}, got {value}")
    return value


def _real(name: str, value: Any, low: float, high: float) -> float:
    """A finite real number (not a bool) in [low, high]."""
    if type(value) not in (float, int) and (isinstance(value, bool) or not isinstance(value, Real)):
        raise InvalidRequestError(f"{name} must be a number, got {type(value).__name__} {_shown(value)}")
    try:
        value = float(value)
    except OverflowError:  # an integer beyond float64
        value = math.inf
    if not math.isfinite(value) or not low <= value <= high:
        raise InvalidRequestError(f"{name} must be a finite number in [{low:g}, {high:g}], got {value:g}")
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be true or false, got {type(value).__name__} {_shown(value)}")
    return value


class StopStrings(tuple):
    """A request's stop strings, validated: at most MAX_STOP_STRINGS non-empty strings of at most
    MAX_STOP_STRING_CHARS characters each, with a UTF-8 form. `failure_tables` are what the stop
    matcher (core/engine/frontend/stop_strings.py) needs of each, made here once for all samples."""

    failure_tables: tuple[list[int], ...]

    def __new__(cls, stop: Any = ()) -> Self:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, (list, tuple)):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"stop holds {len(stop)} strings, more than the {MAX_STOP_STRINGS} allowed")
        for text in stop:
            if not isinstance(text, str) or not text:
                raise InvalidRequestError(f"stop must be non-empty strings, got {_shown(text)}")
            if len(text) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(f"a stop string has {len(text)} characters, more than the "
                                          f"{MAX_STOP_STRING_CHARS} allowed")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                raise InvalidRequestError(f"stop string {_shown(text)} is not valid Unicode (a lone surrogate at "
                                          f"character {err.start})") from None
        self = super().__new__(cls, stop)
        self.failure_tables = tuple(failure_table(text) for text in self)
        return self
