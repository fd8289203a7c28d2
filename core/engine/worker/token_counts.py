"""Token counts on the device, for the penalties (repetition, frequency, presence).

A penalized request keeps a TokenCounts for its whole life (Request.token_counts): `output` [V]
float32, how often each token is among its output tokens, and `seen` [V] bool, whether it is in
the prompt or the output (the repetition penalty's set). They are filled from the host's token
lists the first time the request is sampled; after that the sampler adds each token it draws
for the request on the device, right after drawing it (`PenaltyBatch.add`), so the next step's
penalties count it before the host has read it. That is what lets a penalized request run with
async scheduling (core/engine/llm_engine.py): the next step is launched before this one's tokens
reach the host. Every token the sampler draws for a live request becomes its next output token
(a discarded draw belongs to a request that has finished), so the counts always equal those of
the host's lists once the pending tokens are applied, and the tokens equal synchronous stepping's.
"""

from __future__ import annotations

import itertools

import torch

from deepinfer.core.engine.worker.transfers import to_device


class TokenCounts:
    """One request's counts on the device; empty until the sampler first samples the request."""

    __slots__ = ("num_counted", "output", "seen")

    def __init__(self) -> None:
        self.output: torch.Tensor | None = None  # [V] float32
        self.seen: torch.Tensor | None = None  # [V] bool
        self.num_counted = -1  # output tokens in `output`, the drawn ones not yet on the host included

    def is_current(self, num_output_tokens: int, vocab_size: int, device: torch.device) -> bool:
        """Whether the counts hold the host's `num_output_tokens` (and maybe pending ones after them)."""
        return (self.output is not None and self.num_counted >= num_output_tokens
                and self.output.shape[0] == vocab_size and self.output.device == device)


class PenaltyBatch:
    """The penalized rows of one sampler call: their counts stacked, and after the draw, the drawn
    tokens added back into each row's TokenCounts.

    index: [P] int64, the rows' positions among the call's N rows; output: [P, V] float32;
    seen: [P, V] bool.
    """

    def __init__(self, index: torch.Tensor, counts: list[TokenCounts]) -> None:
        self.index = index
        self.counts = counts
        self.output = torch.stack([c.output for c in counts])
        self.seen = torch.stack([c.seen for c in counts])

    @classmethod
    def gather(cls, positions: list[int], counts: list[TokenCounts | None], prompts: list[list[int]],
               outputs: list[list[int]], vocab_size: int, device: torch.device) -> PenaltyBatch:
        """The batch of rows `positions`, each with its TokenCounts (None: counted afresh from the host
        lists, kept nowhere) and its prompt and output token ids on the host."""
        counts = [TokenCounts() if c is None else c for c in counts]
        stale = [j for j, c in enumerate(counts) if not c.is_current(len(outputs[j]), vocab_size, device)]
        if stale:  # a request's first sampling: one count from its host lists
            output = token_histogram([outputs[j] for j in stale], vocab_size, device)  # [S, V]
            seen = (token_histogram([prompts[j] for j in stale], vocab_size, device) + output) > 0
            for k, j in enumerate(stale):
                counts[j].output, counts[j].seen = output[k].clone(), seen[k].clone()
                counts[j].num_counted = len(outputs[j])
        return cls(to_device(positions, torch.int64, device), counts)

    def add(self, token_ids: torch.Tensor) -> None:
        """Count the tokens just drawn (token_ids: [N], all the call's rows) into each row's TokenCounts."""
        tokens = token_ids.index_select(0, self.index)  # [P]
        rows = torch.arange(len(self.counts), device=tokens.device)
        self.output.index_put_((rows, tokens), torch.ones_like(tokens, dtype=self.output.dtype), accumulate=True)
        self.seen.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.bool))
        torch._foreach_copy_([c.output for c in self.counts], list(self.output.unbind(0)))
        torch._foreach_copy_([c.seen for c in self.counts], list(self.seen.unbind(0)))
        for c in self.counts:
            c.num_counted += 1


def token_histogram(histories: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(histories), V] float32: how often each token occurs in each history.

    Ids must be < V: the engine checks prompt ids at admission (on CUDA a bad id is a device assert).
    """
    flat_tokens = list(itertools.chain.from_iterable(histories))
    row_of_token = [row for row, history in enumerate(histories) for _ in history]
    # [2, total]: one host->device copy of both indices.
    index = to_device([row_of_token, flat_tokens], torch.int64, device)
    counts = torch.zeros(len(histories), vocab_size, dtype=torch.float32, device=device)
    ones = torch.ones(len(flat_tokens), dtype=torch.float32, device=device)
    counts.index_put_((index[0], index[1]), ones, accumulate=True)
    return counts
