"""Benchmark prompts: random token ids of fixed lengths, optionally behind one shared prefix.

Speed does not depend on what the tokens say, so the benchmarks skip the tokenizer and send token
ids straight to the engine; a fixed length per prompt keeps runs comparable across engines and
configurations. A shared prefix (the same system prompt in front of every request) is what makes
the prefix cache matter; without one, random prompts never share a full block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from deepinfer.core.errors import InvalidRequestError

# Low ids are special tokens in most vocabularies (bos/eos/pad/unk); keeping prompts out of
# them keeps every prompt an ordinary text-like sequence on every model.
_FIRST_ORDINARY_ID = 16


def random_token_ids(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    """`length` ids drawn uniformly from the ordinary part of the vocabulary."""
    low = _FIRST_ORDINARY_ID if vocab_size > 2 * _FIRST_ORDINARY_ID else 0
    return rng.integers(low, vocab_size, size=length).tolist()


def make_prompts(num_prompts: int, prompt_len: int, vocab_size: int, *, shared_prefix_len: int = 0,
                 seed: int | Sequence[int] = 0) -> list[list[int]]:
    """`num_prompts` prompts of exactly `prompt_len` ids each.

    The first `shared_prefix_len` ids are the same in every prompt; the rest differ per prompt.
    The same seed always gives the same prompts, so an engine and its peer see identical input;
    a tuple seed like (base, level, repeat) gives each run its own independent prompts.
    """
    if num_prompts < 1:
        raise InvalidRequestError(f"number of prompts must be >= 1, got {num_prompts}")
    if prompt_len < 1:
        raise InvalidRequestError(f"prompt length must be >= 1, got {prompt_len}")
    if not 0 <= shared_prefix_len < prompt_len:
        raise InvalidRequestError(f"shared prefix length must be in [0, prompt length {prompt_len}), got {shared_prefix_len}")
    if vocab_size < 2:
        raise InvalidRequestError(f"vocab size must be >= 2, got {vocab_size}")
    rng = np.random.default_rng(list(seed) if isinstance(seed, Sequence) else seed)
    prefix = random_token_ids(rng, shared_prefix_len, vocab_size)
    return [prefix + random_token_ids(rng, prompt_len - shared_prefix_len, vocab_size) for _ in range(num_prompts)]


def default_num_requests(concurrency: int) -> int:
    """Enough requests per level that the steady state dominates: two waves, at least 8."""
    return max(2 * concurrency, 8)


def per_level_counts_ok(counts: int | list[int] | None, num_levels: int) -> bool:
    """A level's request count option: None (the default), one count >= 1 for every level, or a count >= 1
    for each of the `num_levels` levels."""
    if counts is None:
        return True
    if isinstance(counts, int):
        return counts >= 1
    return len(counts) == num_levels and all(count >= 1 for count in counts)
