"""KV budget: how many KV blocks the engine allocates, decided once at start-up.

In order of precedence:

    num_gpu_blocks        exactly that many blocks (tests)
    kv_cache_memory       exactly that many bytes for the pool
    CPU                   cpu_kv_cache_memory bytes
    max_vram              max_vram - peak torch memory of the warm-up (weights + activations)
                          - CUDA graph memory - the holes in torch's segments
    otherwise             total * gpu_memory_utilization - reserve_memory_mb - peak - CUDA graph
                          memory - memory held outside torch (CUDA context, other processes)

On a GPU the peak comes from a warm-up forward of `max_num_batched_tokens` tokens measured with
`torch.cuda.max_memory_allocated` (the warm-up's own scratch KV blocks subtracted). Every GPU
budget is also capped by what is actually free, minus `reserve_memory_mb` and the activation
headroom the warm-up needed, so the pool never pushes the first real step out of memory. The CUDA
context itself sits outside `max_vram`: torch cannot measure it per process.

Under `max_vram` the pool also gives up the holes left between the weights in torch's segments (what
torch still reserves beyond its allocations once its cache is emptied: freed parts of merged
projections and load-time temporaries that core/models/compaction.py did not give back): a budget that
counted allocations only would let the reservation pass `max_vram` by them (docs/RESULTS.md).

CUDA graphs are captured after the pool is allocated (they bind its addresses), so their memory is
measured before, on a scratch cache: the static input/output buffers, and the largest graph
captured alone and let go (its pool, which all graphs share, plus what one instantiated graph
costs, times the number of graphs), the dummy block, and a margin. The capture logs what the
graphs really hold, and warns if that is more.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

from deepinfer.core.config import EngineConfig
from deepinfer.core.errors import DeepInferError

logger = logging.getLogger(__name__)

MiB = 1024**2


@dataclass
class DeviceMemory:
    """What the warm-up measured on a GPU, in bytes."""

    total: int  # device memory
    free: int  # free on the device after the warm-up (torch's cache emptied)
    torch_reserved: int  # held by torch's allocator now
    torch_allocated: int  # allocated by tensors now (weights and buffers)
    peak_allocated: int  # torch peak during the warm-up, its scratch KV blocks excluded
    cuda_graph_bytes: int = 0  # estimated memory of the decode CUDA graphs still to be captured


@dataclass
class KVBudget:
    source: str  # the setting that decided it (num_gpu_blocks, kv_cache_memory, max_vram, ...)
    budget_bytes: int  # bytes the pool may use
    block_bytes: int  # bytes one block costs, all layers, K and V (scales included)
    num_blocks: int
    weights_bytes: int | None = None  # GPU only: torch memory held after loading, mostly weights
    activation_peak_bytes: int | None = None  # GPU only: warm-up peak above the weights
    cuda_graph_bytes: int | None = None  # GPU only: memory set aside for the decode CUDA graphs

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "pool_bytes": self.pool_bytes}


def plan_kv_budget(config: EngineConfig, block_bytes: int, memory: DeviceMemory | None) -> KVBudget:
    """The pool size for `config`; `memory` is None on the CPU. DeepInferError when not one block fits."""
    if config.num_gpu_blocks is not None:
        num_blocks = config.num_gpu_blocks
        return KVBudget("num_gpu_blocks", num_blocks * block_bytes, block_bytes, num_blocks)
    weights = activations = graphs = None
    if config.kv_cache_memory is not None:
        source, budget = "kv_cache_memory", config.kv_cache_memory
    elif memory is None:
        source, budget = "cpu_kv_cache_memory", config.cpu_kv_cache_memory
    else:
        weights = memory.torch_allocated
        activations = max(0, memory.peak_allocated - memory.torch_allocated)
        graphs = memory.cuda_graph_bytes
        reserve = config.reserve_memory_mb * MiB
        # Free now, plus torch's cached but unused memory, minus room for the next peak and the graphs.
        available = memory.free + memory.torch_reserved - memory.torch_allocated - activations - reserve - graphs
        if config.max_vram is not None:
            holes = memory.torch_reserved - memory.torch_allocated
            source, budget = "max_vram", min(config.max_vram - memory.peak_allocated - graphs - holes, available)
        else:
            outside_torch = memory.total - memory.free - memory.torch_reserved
            allowed = int(memory.total * config.gpu_memory_utilization) - reserve
            limit = allowed - memory.peak_allocated - graphs - outside_torch
            source, budget = "gpu_memory_utilization", min(limit, available)
    num_blocks = max(0, budget) // block_bytes
    if num_blocks < 1:
        detail = ""
        if weights is not None:
            detail = (f" (weights {weights / MiB:.0f} MiB, warm-up activations {activations / MiB:.0f} MiB, "
                      f"CUDA graphs {graphs / MiB:.0f} MiB)")
        raise DeepInferError(
            f"no room for the KV cache: the {source} budget leaves {budget / MiB:.1f} MiB{detail}, "
            f"one KV block needs {block_bytes / MiB:.2f} MiB; allow more memory or lower "
            f"max_num_batched_tokens{' or max_num_seqs (or enforce_eager: no CUDA graphs)' if graphs else ''}")
    return KVBudget(source, budget, block_bytes, num_blocks, weights, activations, graphs)


def log_kv_budget(budget: KVBudget, block_size: int) -> None:
    extra = ""
    if budget.weights_bytes is not None:
        extra = (f", weights {budget.weights_bytes / MiB:.0f} MiB, "
                 f"warm-up activations {budget.activation_peak_bytes / MiB:.0f} MiB, "
                 f"CUDA graphs {budget.cuda_graph_bytes / MiB:.0f} MiB")
    logger.info("KV cache: budget %.1f MiB (%s), %d bytes per block of %d tokens, %d blocks = %d tokens%s",
                budget.budget_bytes / MiB, budget.source, budget.block_bytes, block_size, budget.num_blocks,
                budget.num_blocks * block_size, extra)
