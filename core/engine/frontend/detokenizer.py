"""IncrementalDetokenizer: one sample's output tokens -> streamed text, with stop checks.

Decoding follows vLLM's prefix_offset / read_offset scheme: the text of a new token is
`decode(ids[prefix_offset:]) - decode(ids[prefix_offset:read_offset])`, so tokenizers whose
decoders depend on context (SentencePiece's leading space, byte-level BPE pieces of one UTF-8
character) come out right, and a window that still ends in an incomplete character ("\\ufffd")
is held until the next token completes it. The window starts on the last prompt tokens so the
first output token gets its leading space. With a `tokenizers` (Rust) backend the same scheme runs
inside the library (`tokenizers.decoders.DecodeStream`, about a microsecond a token, no Python
list slicing or second decode); other tokenizers, and HF tokenizers that clean up spaces after
decoding (which the stream does not), take the Python window.

Stop strings: the text is cut right before the earliest stop string, and any tail of the text
that could still grow into a stop string is held back from the stream until it is resolved, so
no part of a stop string ever reaches a delta. When the request finishes otherwise, the held text
is released. Only each step's new text goes to the stop matcher (core/engine/frontend/stop_strings.py), so a
step's stop checks cost the same at the 10th and the 10,000th token.

The tokenizer needs `decode(ids: list[int], skip_special_tokens: bool) -> str` (an HF fast tokenizer
has it; core.tokenizer.Tokenizer must expose the same).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers.decoders import DecodeStream

from deepinfer.core.engine.frontend.stop_strings import StopStringMatcher
from deepinfer.core.engine.sampling_params import SamplingParams

# Prompt tokens kept as decoding context for the first output tokens (vLLM uses 5).
_PROMPT_CONTEXT_TOKENS = 5


@dataclass
class DetokenizerStep:
    delta_text: str  # new text to stream; may be "" while text is held back
    finished: bool
    finish_reason: str | None  # "stop" or "length" once finished
    stop_reason: str | int | None  # the stop string or stop token id; None for eos and "length"


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer, prompt_token_ids: list[int], params: SamplingParams, eos_token_ids: set[int]
    ) -> None:
        self._params = params
        self._stop_token_ids = params.stop_token_ids  # a frozenset, shared by the request's samples
        self._eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self._stop_matcher = StopStringMatcher(params.stop, params.stop.failure_tables) if params.stop else None
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._decoder = _stream_decoder(tokenizer, context, params.skip_special_tokens) or _WindowDecoder(
            tokenizer, context, params.skip_special_tokens)
        self.output_token_ids: list[int] = []
        self._text = ""  # decoded output text, cut at a stop string once one is found
        self._num_streamed = 0  # characters of _text already returned as deltas
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The text streamed so far (all deltas joined); the whole output text once finished."""
        return self._text[: self._num_streamed]

    def append(self, token_id: int) -> DetokenizerStep:
        """Takes the next sampled token; returns the text it releases and whether the sample ended."""
        if self.finished:
            raise RuntimeError(f"detokenizer: token {token_id} appended after finish ({self.finish_reason})")
        self.output_token_ids.append(token_id)
        text_len_before = len(self._text)
        at_max_tokens = len(self.output_token_ids) >= self._params.max_tokens
        decoder = self._decoder
        if token_id in self._stop_token_ids or token_id in self._eos_token_ids:
            # The stop token's own text is not part of the output.
            self._text += decoder.flush()
            self._finish("stop", token_id if token_id in self._stop_token_ids else None)
        else:
            self._text += decoder.next(token_id)
            if at_max_tokens:
                self._text += decoder.flush()
                self._finish("length", None)
        self._check_stop_strings(text_len_before)
        return DetokenizerStep(self._release(), self.finished, self.finish_reason, self.stop_reason)

    def _finish(self, reason: str, stop_reason: str | int | None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def _check_stop_strings(self, text_len_before: int) -> None:
        """Cuts the text before the earliest stop string that the new text completes."""
        if self._stop_matcher is None or len(self._text) == text_len_before:
            return
        match = self._stop_matcher.feed(self._text[text_len_before:])
        if match is not None:
            index, stop = match
            self._text = self._text[:index]
            self._finish("stop", stop)

    def _release(self) -> str:
        """Returns the text that can be streamed now, holding back a possible stop-string start."""
        end = len(self._text)
        if not self.finished and self._stop_matcher is not None:
            end -= self._stop_matcher.held_back
        delta = self._text[self._num_streamed:end] if end > self._num_streamed else ""
        self._num_streamed = max(self._num_streamed, end)
        return delta


class _WindowDecoder:
    """The prefix_offset / read_offset window in Python, over any tokenizer's `decode`."""

    def __init__(self, tokenizer, context: list[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window_ids = context  # prompt context + output ids whose text is decoded
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(context)  # decode(ids[prefix_offset:read_offset])

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def next(self, token_id: int) -> str:
        """Text completed by the newest token; "" while the window ends mid-character."""
        self._window_ids.append(token_id)
        window_text = self._decode(self._window_ids[self._prefix_offset:])
        if len(window_text) <= len(self._prefix_text) or window_text.endswith("\ufffd"):
            return ""
        new_text = window_text[len(self._prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._window_ids)
        self._prefix_text = self._decode(self._window_ids[self._prefix_offset:self._read_offset])
        return new_text

    def flush(self) -> str:
        """All text not yet returned, even an incomplete character: the output ends here."""
        window_text = self._decode(self._window_ids[self._prefix_offset:])
        self._read_offset = len(self._window_ids)
        return window_text[len(self._prefix_text):]


class _StreamDecoder:
    """The same window inside the `tokenizers` library (DecodeStream); it keeps the ids not decoded yet
    so that `flush` can still give an incomplete character's text, as the Python window does."""

    def __init__(self, backend, context: list[int], skip_special_tokens: bool) -> None:
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._last_ids = context  # the ids of the last text returned (context for a flush)
        self._pending_ids: list[int] = []  # ids whose text the stream still holds

    def next(self, token_id: int) -> str:
        text = self._stream.step(self._backend, token_id)
        self._pending_ids.append(token_id)
        if text is None:
            return ""
        self._last_ids, self._pending_ids = self._pending_ids, []
        return text

    def flush(self) -> str:
        if not self._pending_ids:
            return ""
        decode = self._backend.decode
        context = decode(self._last_ids, skip_special_tokens=self._skip_special_tokens)
        text = decode(self._last_ids + self._pending_ids, skip_special_tokens=self._skip_special_tokens)
        self._last_ids, self._pending_ids = self._last_ids + self._pending_ids, []
        return text[len(context):]


def _stream_decoder(tokenizer, context: list[int], skip_special_tokens: bool) -> _StreamDecoder | None:
    """A _StreamDecoder when `tokenizer` (core.tokenizer.Tokenizer or an HF tokenizer) has a `tokenizers`
    backend whose decode the stream reproduces (no clean-up of spaces after decoding), and the prompt
    context decodes to whole characters."""
    hf_tokenizer = getattr(tokenizer, "hf_tokenizer", tokenizer)
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(hf_tokenizer, "clean_up_tokenization_spaces", False):
        return None
    if backend.decode(context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
        return None  # a context ending mid-character: the stream would give the context's text as output
    return _StreamDecoder(backend, context, skip_special_tokens)
