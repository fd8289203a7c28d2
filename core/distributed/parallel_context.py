"""ParallelContext: a tensor-parallel rank's place in its process group, and the collectives its layers run.

The model holds one (`DecoderModel.parallel`; None on one device, where every layer runs as it always has).
Collectives go through torch.distributed on the default process group (gloo on the CPU, NCCL on GPUs),
started by core/distributed/process_group.py; rank 0's step messages go over `control_group`, a gloo group
(the default one on the CPU), whose waits for the next step need no device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    rank: int
    world_size: int
    control_group: Any = None  # gloo ProcessGroup of the step messages; None: the default group

    @property
    def is_driver(self) -> bool:
        """Rank 0: runs the scheduler and the sampler, and gets the logits."""
        return self.rank == 0

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of each rank's partial [T, hidden], in place."""
        dist.all_reduce(partial)
        return partial

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Rank 0: every rank's logits slice [N, V_r] -> [N, vocab_size] in rank order (slices differ in width by
        at most one, so each is padded to the widest for the gather). Other ranks: their own slice, unchanged."""
        width = -(-vocab_size // self.world_size)
        padded = local
        if local.shape[1] != width:
            padded = torch.nn.functional.pad(local, (0, width - local.shape[1]))
        padded = padded.contiguous()
        if not self.is_driver:
            dist.gather(padded, None, dst=0)
            return local
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.gather(padded, parts, dst=0)
        base, extra = divmod(vocab_size, self.world_size)
        return torch.cat([part[:, :base + (r < extra)] for r, part in enumerate(parts)], dim=1)
