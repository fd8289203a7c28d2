"""IncrementalDetokenizer: one sample's output tokens -> streamed text, with stop checks.

Decoding follows vLLM's prefix_offset / read_offset scheme: the text of a new token is
`decode(ids[prefix_offset:]) - decode(ids[prefix_offset:read_offset])`, so tokenizers whose
decoders depend on context (SentencePiece's leading space, byte-level BPE pieces of one UTF-8
character) come out right, and a window that still ends in an incomplete character ("\\ufffd")
is held until the next token completes it. The window starts on the last prompt tokens so the
first output token gets its leading space.

Stop strings: the text is cut right before the earliest stop string, and any tail of the text
that could still grow into a stop string is held back from the stream until it is resolved, so
no part of a stop string ever reaches a delta. When the request finishes otherwise, the held text
is released. Only each step's new text goes to the stop matcher (core/engine/stop_strings.py), so a
step's stop checks cost the same at the 10th and the 10,000th token.

The tokenizer needs `decode(ids: list[int], skip_special_tokens: bool) -> str` (an HF fast tokenizer
has it; core.tokenizer.Tokenizer must expose the same).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.engine.stop_strings import StopStringMatcher

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
        self._tokenizer = tokenizer
        self._params = params
        self._stop_token_ids = params.stop_token_ids  # a frozenset, shared by the request's samples
        self._eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self._stop_matcher = StopStringMatcher(params.stop, params.stop.failure_tables) if params.stop else None
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._window_ids = context  # prompt context + output ids whose text is decoded
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(context)  # decode(ids[prefix_offset:read_offset])
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
        if token_id in self._stop_token_ids or token_id in self._eos_token_ids:
            # The stop token's own text is not part of the output.
            self._text += self._flush_decoding()
            self._finish("stop", token_id if token_id in self._stop_token_ids else None)
        else:
            self._window_ids.append(token_id)
            self._text += self._flush_decoding() if at_max_tokens else self._decode_next()
            if at_max_tokens:
                self._finish("length", None)
        self._check_stop_strings(text_len_before)
        return DetokenizerStep(self._release(), self.finished, self.finish_reason, self.stop_reason)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._params.skip_special_tokens)

    def _decode_next(self) -> str:
        """Text completed by the window's newest token; "" while it ends mid-character."""
        window_text = self._decode(self._window_ids[self._prefix_offset:])
        if len(window_text) <= len(self._prefix_text) or window_text.endswith("\ufffd"):
            return ""
        new_text = window_text[len(self._prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._window_ids)
        self._prefix_text = self._decode(self._window_ids[self._prefix_offset:self._read_offset])
        return new_text

    def _flush_decoding(self) -> str:
        """All text not yet decoded, even an incomplete character: the output ends here."""
        window_text = self._decode(self._window_ids[self._prefix_offset:])
        self._read_offset = len(self._window_ids)
        return window_text[len(self._prefix_text):]

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
