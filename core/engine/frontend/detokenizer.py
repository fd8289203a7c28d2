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

import weakref
from dataclasses import dataclass

from tokenizers.decoders import ByteLevel, DecodeStream

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
    __slots__ = (
        "_decoder",
        "_ending_token_ids",
        "_held_text",
        "_max_tokens",
        "_stop_matcher",
        "_stop_token_ids",
        "finish_reason",
        "num_tokens",
        "pieces",
        "stop_reason",
    )

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
        self.num_tokens = 0  # output tokens taken
        self.pieces: list[str] = []  # the deltas returned, in order (the text is their join)
        # Decoded text not returned yet (with stop strings only): a tail that could still grow into a stop.
        self._held_text = ""
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The text streamed so far (all deltas joined); the whole output text once finished."""
        return "".join(self.pieces)

    def append(self, token_id: int) -> DetokenizerStep:
        """Takes the next sampled token; returns the text it releases and whether the sample ended."""
        delta_text = self.append_text(token_id)
        return DetokenizerStep(delta_text, self.finished, self.finish_reason, self.stop_reason)

    def append_text(self, token_id: int) -> str:
        """`append` without the step object (the output processor's path, once per token): -> the text the
        token releases; `finish_reason` and `stop_reason` say whether and why the sample ended."""
        if self.finish_reason is not None:
            raise RuntimeError(f"detokenizer: token {token_id} appended after finish ({self.finish_reason})")
        self.num_tokens += 1
        if token_id in self._ending_token_ids:
            # The stop token's own text is not part of the output.
            new_text = self._decoder.flush()
            self.finish_reason = "stop"
            self.stop_reason = token_id if token_id in self._stop_token_ids else None
        else:
            new_text = self._decoder.next(token_id)
            if self.num_tokens >= self._max_tokens:
                new_text += self._decoder.flush()
                self.finish_reason = "length"
        matcher = self._stop_matcher
        if matcher is not None:
            # Of the held text and the new, what can be streamed: cut before the earliest stop string the new
            # text completes, less a tail that could still grow into one (held until it is resolved).
            text = self._held_text + new_text
            if new_text:
                # Only the new text goes to the matcher. Its match offsets count from the output's start, and
                # a stop never starts inside the streamed text (that was held), so it cuts inside `text`.
                streamed_len = matcher.text_len - len(self._held_text)
                match = matcher.feed(new_text)
                if match is not None:
                    text = text[:match[0] - streamed_len]
                    self.finish_reason, self.stop_reason = "stop", match[1]
            end = len(text) if self.finish_reason is not None else len(text) - matcher.held_back
            if end <= 0:
                self._held_text = text
                return ""
            self._held_text, new_text = text[end:], text[:end]
        if new_text:
            self.pieces.append(new_text)
        return new_text


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

    __slots__ = ("_backend", "_ids", "_last_start", "_pending_start", "_skip_special_tokens", "_step")

    def __init__(self, backend, context: list[int], skip_special_tokens: bool) -> None:
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._step = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens).step
        # Context and output ids; [_last_start:_pending_start] made the last text returned (a flush's
        # context), [_pending_start:] are the ids whose text the stream still holds.
        self._ids = context
        self._last_start, self._pending_start = 0, len(context)

    def next(self, token_id: int) -> str:
        ids = self._ids
        ids.append(token_id)
        text = self._step(self._backend, token_id)
        if text is None:
            return ""
        self._last_start, self._pending_start = self._pending_start, len(ids)
        return text

    def flush(self) -> str:
        ids, start = self._ids, self._pending_start
        if start == len(ids):
            return ""
        decode, skip = self._backend.decode, self._skip_special_tokens
        context = decode(ids[self._last_start:start], skip_special_tokens=skip)
        text = decode(ids[self._last_start:], skip_special_tokens=skip)
        self._pending_start = len(ids)
        return text[len(context):]


class _ByteLevelDecoder:
    """The library stream's deltas for a byte-level BPE tokenizer (GPT-2 style: Qwen, Llama 3, SmolLM), from
    tables instead of a library call per token. Its decoder maps each token to bytes on its own (the
    characters of its byte alphabet, else the token's UTF-8) and decodes their concatenation as lossy UTF-8,
    so a token whose bytes are whole characters after a complete text adds exactly its own text: one list
    index. Bytes that end mid-character wait (as the stream holds them) until a later token completes them."""

    __slots__ = ("_bytes", "_pending", "_texts")

    def __init__(self, table: _ByteLevelTable) -> None:
        self._texts, self._bytes = table.texts, table.token_bytes
        self._pending = b""  # bytes not returned yet: they end mid-character

    def next(self, token_id: int) -> str:
        try:
            text = self._texts[token_id]
        except IndexError:  # an id past the vocabulary decodes to nothing, as in the library
            return ""
        if text is not None and not self._pending:
            return text
        self._pending += self._bytes[token_id]
        text = self._pending.decode("utf-8", "replace")
        if text.endswith("\ufffd"):  # the stream's test: what it decodes may still complete a character
            return ""
        self._pending = b""
        return text

    def flush(self) -> str:
        text, self._pending = self._pending.decode("utf-8", "replace"), b""
        return text


class _ByteLevelTable:
    """[vocabulary] per id: `token_bytes` its bytes under the byte-level decoder (b"" for a special token
    skipped), `texts` their text where that is whole characters not ending in U+FFFD, else None. Built once per
    tokenizer and skip_special_tokens, when the output processor starts (tens of ms for 150k ids)."""

    def __init__(self, backend, skip_special_tokens: bool) -> None:
        skipped = {i for i, token in backend.get_added_tokens_decoder().items() if token.special} \
            if skip_special_tokens else set()
        vocab = backend.get_vocab(with_added_tokens=True)
        self.token_bytes: list[bytes] = [b""] * (max(vocab.values(), default=-1) + 1)
        to_latin1 = _ALPHABET_TO_LATIN1
        for token, token_id in vocab.items():
            if token_id not in skipped:
                try:
                    self.token_bytes[token_id] = token.translate(to_latin1).encode("latin-1")
                except UnicodeEncodeError:  # a character outside the byte alphabet (an added token): its UTF-8
                    self.token_bytes[token_id] = token.encode("utf-8")
        self.texts: list[str | None] = []
        for piece in self.token_bytes:
            text = piece.decode("utf-8", "replace")
            self.texts.append(None if text.endswith("\ufffd") or text.encode("utf-8") != piece else text)


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level BPE vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


# str.translate table: each alphabet character -> the character of its byte's Latin-1 code (so that
# .encode("latin-1") gives the bytes), every other character below 256 -> one Latin-1 cannot encode.
_ALPHABET_TO_LATIN1 = {**{code: "\uffff" for code in range(256)},
                       **{ord(char): chr(byte) for byte, char in _byte_alphabet().items()}}


# (backend, skip_special_tokens) -> its table, while the tokenizer lives
_BYTE_LEVEL_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prepare_tables(tokenizer) -> None:
    """Build the byte-level tables of `tokenizer` now (for streams that skip special tokens, the default),
    instead of in its first request."""
    hf_tokenizer = getattr(tokenizer, "hf_tokenizer", tokenizer)
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is not None and isinstance(backend.decoder, ByteLevel):
        _byte_level_table(backend, True)


def _byte_level_table(backend, skip_special_tokens: bool) -> _ByteLevelTable:
    tables = _BYTE_LEVEL_TABLES.setdefault(backend, {})
    if skip_special_tokens not in tables:
        tables[skip_special_tokens] = _ByteLevelTable(backend, skip_special_tokens)
    return tables[skip_special_tokens]


# Text that transformers' clean-up of tokenization spaces changes (" ." -> ".", " n't" -> "n't", ...).
_CLEAN_UP_PROBE = "a . b , c ! d ? e 's f n't g 'm h 've i 're j"
# backend -> whether its HF tokenizer's decode cleans up spaces, while the tokenizer lives
_CLEANS_UP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cleans_up_spaces(hf_tokenizer, backend) -> bool:
    """Whether `hf_tokenizer.decode` post-processes the backend's text (clean_up_tokenization_spaces), which
    the stream would not reproduce. The attribute alone does not say: transformers 5 keeps it True from a
    tokenizer_config.json (Llama 3's, some GGUF conversions) yet ignores it for BPE tokenizers, so the probe's
    two decodes decide, once per tokenizer."""
    if not getattr(hf_tokenizer, "clean_up_tokenization_spaces", False):
        return False
    if backend not in _CLEANS_UP:
        ids = backend.encode(_CLEAN_UP_PROBE, add_special_tokens=False).ids
        _CLEANS_UP[backend] = hf_tokenizer.decode(ids) != backend.decode(ids)
    return _CLEANS_UP[backend]


def _stream_decoder(tokenizer, context: list[int], skip_special_tokens: bool
                    ) -> _ByteLevelDecoder | _StreamDecoder | None:
    """A decoder of the library stream's deltas when `tokenizer` (core.tokenizer.Tokenizer or an HF tokenizer)
    has a `tokenizers` backend whose decode the stream reproduces (no clean-up of spaces after decoding), and
    the prompt context decodes to whole characters: the tables of a byte-level decoder, else the stream."""
    hf_tokenizer = getattr(tokenizer, "hf_tokenizer", tokenizer)
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None or _cleans_up_spaces(hf_tokenizer, backend):
        return None
    if backend.decode(context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
        return None  # a context ending mid-character: the stream would give the context's text as output
    if isinstance(backend.decoder, ByteLevel):
        return _ByteLevelDecoder(_byte_level_table(backend, skip_special_tokens))
    return _StreamDecoder(backend, context, skip_special_tokens)
