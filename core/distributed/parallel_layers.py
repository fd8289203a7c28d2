"""The two modules a tensor-parallel rank puts in place of full ones: a row-parallel linear (its partial
product summed over ranks) and a vocabulary-parallel embedding (a masked lookup of the rank's rows, summed)."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.core.distributed.parallel_context import ParallelContext


class RowParallel(nn.Module):
    """o_proj / down_proj of a rank: `linear` holds the rank's input columns (K shard), so its product is a
    partial sum of the full one; the all-reduce completes it. The bias, if any, is rank 0's alone."""

    def __init__(self, linear: nn.Module, parallel: ParallelContext) -> None:
        super().__init__()
        self.linear = linear
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K_r] -> [T, hidden], the same on every rank
        return self.parallel.all_reduce(self.linear(x))


class VocabParallelEmbedding(nn.Module):
    """The rank's rows [start, end) of the embedding; `weight` [end - start, hidden] is also the tied head's
    slice. Token ids outside the range look up row 0 and are zeroed, so the all-reduce sums exactly one row."""

    def __init__(self, weight: torch.Tensor, start: int, parallel: ParallelContext) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.parallel = parallel

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        rows = nn.functional.embedding(torch.where(inside, local, 0), self.weight)
        return self.parallel.all_reduce(rows * inside.unsqueeze(-1).to(rows.dtype))
