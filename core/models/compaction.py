"""Weights re-laid in fresh allocator segments when loading left holes between them.

Merging q/k/v and gate/up (core/models/merged_projections.py) allocates each merged product beside
its parts and then frees the parts, and load-time temporaries are freed the same way. torch's
caching allocator cannot give those holes back to the device while a weight still sits in the
same segment, so they stay reserved and, under `max_vram`, come out of the KV pool
(core/engine/worker/memory.py; docs/RESULTS.md, "Inside a 4 GiB budget", gives their size for a 3B model). A round trip through host memory
after loading lays every weight out again in fresh segments, before any step has run.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Below this the round trip (about a second per few GB over PCIe) is not worth its time.
MIN_HOLE_BYTES = 64 << 20


def reserved_holes(device: torch.device) -> int:
    """Bytes torch reserves on `device` beyond its allocations once its cache is emptied."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def compact_weights(model: nn.Module, device: torch.device) -> int:
    """Moves `model` to the host and back when the holes reach MIN_HOLE_BYTES; returns the bytes of
    holes given back. Nothing may hold the model's device tensors by address yet (no step has run)."""
    before = reserved_holes(device)
    if before < MIN_HOLE_BYTES:
        return 0
    model.to("cpu")
    torch.cuda.empty_cache()
    model.to(device)
    after = reserved_holes(device)
    logger.info("weights re-laid in fresh segments: %.0f MiB of holes between them given back",
                (before - after) / 2**20)
    return before - after
