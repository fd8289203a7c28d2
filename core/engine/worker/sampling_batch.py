"""SamplingBatch: what a sampler call needs of its rows' parameters, kept while the rows stay the same.

A decode batch holds the same requests in the same order step after step (it changes only when a
request joins, finishes or is preempted), and a row's parameters never change (SamplingRow resolves
them once, the model runner makes one row per request). So the host's per-row work of a call (which
rows are greedy, penalized, biased, seeded or ask for logprobs, and the device tensors of their
settings) is done once per batch of rows and reused by every call over the same row objects, as
vLLM's persistent batch keeps its sampling metadata: a steady decode step costs no Python per row here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.engine.worker.transfers import to_device

if TYPE_CHECKING:
    from deepinfer.core.engine.worker.sampler import SamplingRow

# Below this temperature a row is sampled greedily: logits / T would overflow float32 (vLLM: same).
GREEDY_TEMPERATURE = 1e-5


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE


def has_penalties(params: SamplingParams) -> bool:
    """Whether sampling the row applies a repetition, frequency or presence penalty."""
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


class SamplingBatch:
    """The per-row facts of one list of rows on one device and vocabulary (the row objects are compared by
    identity, `serves`). Device tensors are made on first use and only read afterwards."""

    def __init__(self, rows: list[SamplingRow], device: torch.device, vocab_size: int) -> None:
        self.rows = list(rows)
        self.device, self.vocab_size = device, vocab_size
        params = [row.params for row in rows]
        self.params = params
        self.num_top = [p.logprobs for p in params]  # [N], each row's params.logprobs
        self.logprob_rows = [i for i, n in enumerate(self.num_top) if n is not None]
        self.max_top = max((self.num_top[i] for i in self.logprob_rows), default=0)
        # [L] on the device; None when no row or every row asked (no gather needed).
        self.logprob_index = None
        if self.logprob_rows and len(self.logprob_rows) < len(rows):
            self.logprob_index = to_device(self.logprob_rows, torch.int64, device)
        self.biased = [i for i, p in enumerate(params) if p.logit_bias]
        self.penalized = [i for i, p in enumerate(params) if has_penalties(p)]
        self.greedy = [is_greedy(p) for p in params]
        self.all_greedy, self.any_greedy = all(self.greedy), any(self.greedy)
        self.generators = [row.generator for row in rows if row.generator is not None]  # every seeded row's
        # Rows drawing from their own generator: seeded and not greedy.
        self.seeded = [(i, row.generator) for i, (row, greedy) in enumerate(zip(rows, self.greedy))
                       if row.generator is not None and not greedy]
        self.any_min_p = any(p.min_p > 0 for p in params)
        self.uses_top_p = any(p.top_p < 1.0 for p in params)
        self.uses_top_k = any(0 < p.top_k < vocab_size for p in params)
        self._penalty_factors: torch.Tensor | None = None
        self._random_settings: torch.Tensor | None = None

    def serves(self, rows: list[SamplingRow], device: torch.device, vocab_size: int) -> bool:
        """Whether these are the same row objects, in the same order, on the same device and vocabulary."""
        return rows == self.rows and device == self.device and vocab_size == self.vocab_size

    def penalty_factors(self) -> torch.Tensor:
        """[P, 3] float32 on the device: repetition, frequency, presence of each penalized row."""
        if self._penalty_factors is None:
            params = [self.params[i] for i in self.penalized]
            self._penalty_factors = to_device(
                [(p.repetition_penalty, p.frequency_penalty, p.presence_penalty) for p in params],
                torch.float32, self.device)
        return self._penalty_factors

    def any_repetition_penalty(self) -> bool:
        return any(self.params[i].repetition_penalty != 1.0 for i in self.penalized)

    def random_settings(self) -> torch.Tensor:
        """[N, 5] float32 on the device: temperature (1 for greedy rows, so their division is harmless),
        top_p, top_k (V when off; exact in float32 below 2**24), log(min_p), greedy flag."""
        if self._random_settings is None:
            vocab_size = self.vocab_size
            self._random_settings = to_device(
                [
                    (
                        1.0 if greedy else p.temperature,
                        p.top_p,
                        p.top_k if 0 < p.top_k < vocab_size else vocab_size,
                        math.log(p.min_p) if p.min_p > 0 else -math.inf,
                        float(greedy),
                    )
                    for p, greedy in zip(self.params, self.greedy)
                ],
                torch.float32,
                self.device,
            )
        return self._random_settings
