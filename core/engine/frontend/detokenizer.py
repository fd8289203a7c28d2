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
        self._max_tokens = params.max_tokens
        self._stop_token_ids = params.stop_token_ids  # a frozenset, shared by the request's samples
        eos = frozenset() if params.ignore_eos else eos_token_ids
        self._ending_token_ids = self._stop_token_ids | eos  # as Request.ending_token_ids: one set test per token
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
        delta_text = self.append_text(token_id)
        return DetokenizerStep(delta_text, self.finished, self.finish_reason, self.stop_reason)

    def append_text(self, token_id: int) -> str:
        """`append` without the step object (the output processor's path, once per token): -> the text the
        token releases; `finish_reason` and `stop_reason` say whether and why the sample ended."""
        if self.finish_reason is not None:
            raise RuntimeError(f"detokenizer: token {token_id} appended after finish ({self.finish_reason})")
        output_ids = self.output_token_ids
        output_ids.append(token_id)
        text = self._text
        text_len_before = len(text)
        decoder = self._decoder
        if token_id in self._ending_token_ids:
            # The stop token's own text is not part of the output.
            text += decoder.flush()
            self.finish_reason = "stop"
            self.stop_reason = token_id if token_id in self._stop_token_ids else None
        else:
            text += decoder.next(token_id)
            if len(output_ids) >= self._max_tokens:
                text += decoder.flush()
                self.finish_reason = "length"
        matcher = self._stop_matcher
        if matcher is None:
            end = len(text)
        else:
            if len(text) != text_len_before:
                # Only the new text goes to the matcher; the text is cut before the earliest stop it completes.
                match = matcher.feed(text[text_len_before:])
                if match is not None:
                    text = text[:match[0]]
                    self.finish_reason, self.stop_reason = "stop", match[1]
            # Hold back a tail that could still grow into a stop string, until it is resolved.
            end = len(text) if self.finish_reason is not None else len(text) - matcher.held_back
        self._text = text
        streamed = self._num_streamed
        if end <= streamed:
            return ""
        self._num_streamed = end
        return text[streamed:end]


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
