"""The model's vocabulary as llguidance sees it: each token id's bytes, and the end tokens.

The mask has one bit per id of the model's logits (`vocab_size`, which may exceed the tokenizer's
vocabulary: padded embedding rows are never allowed). The grammar's end tokens are the engine's
EOS ids: when a grammar is complete, only they are allowed, so the request stops there.

A dummy-weight model's ByteTokenizer (ids 0..255 are bytes) has no EOS; the first id past the
bytes stands for the end in the grammar (it decodes to nothing), and every other id is a special
token the grammar never allows.
"""

from __future__ import annotations

from collections.abc import Iterable

from deepinfer.core.errors import InvalidRequestError
from deepinfer.core.tokenizer import ByteTokenizer

BYTE_VOCAB_END_TOKEN = 256


class _ByteVocabulary:
    """What llguidance.TokenizerWrapper reads from a tokenizer, for a ByteTokenizer's ids."""

    def __init__(self, vocab_size: int) -> None:
        # llguidance marks special tokens with a leading 0xFF byte (never valid UTF-8).
        self.tokens = [bytes([i]) for i in range(256)] + [b"\xff[%d]" % i for i in range(256, vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))
        self.eos_token_id = BYTE_VOCAB_END_TOKEN
        self.bos_token_id = None

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)


def grammar_tokenizer(tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
    """-> llguidance.LLTokenizer for `tokenizer` (core.tokenizer.Tokenizer or ByteTokenizer).
    Takes about a second for a 150k vocabulary: build it once per engine."""
    import llguidance

    if isinstance(tokenizer, ByteTokenizer):
        if vocab_size <= BYTE_VOCAB_END_TOKEN:
            raise InvalidRequestError("structured outputs need an end token: this byte-vocabulary model has none")
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary(vocab_size)))
    import llguidance.hf

    eos = sorted(eos_token_ids)
    if not eos:
        raise InvalidRequestError("structured outputs need an end-of-sequence token; this tokenizer has none")
    try:
        return llguidance.hf.from_tokenizer(tokenizer.hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
    except Exception as err:  # noqa: BLE001 - llguidance refuses slow tokenizers and odd vocabularies
        raise InvalidRequestError(
            f"structured outputs are not available for this tokenizer: {type(err).__name__}: {err}") from None
