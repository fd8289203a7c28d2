"""The ranks' process group: torch.distributed's default group, gloo on the CPU and NCCL on GPUs.

Rank 0 picks a free local port; every rank joins through it (a TCP store on 127.0.0.1: the ranks of one
engine run on one host). The group's timeout bounds every collective of a step, so a rank that hangs mid-step
ends the others' wait with an error instead of a hang (one that exits closes its connections: at once). On
GPUs a second, gloo group carries rank 0's step messages on the host (the other ranks wait there between
steps, as long as the engine is idle: core/distributed/step_message.py).
"""

from __future__ import annotations

import contextlib
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from deepinfer.core.distributed.parallel_context import ParallelContext
from deepinfer.core.errors import DeepInferError

COLLECTIVE_TIMEOUT_S = 120.0
LEAVE_TIMEOUT_S = 10.0  # how long a rank that leaves waits for the others to leave too


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def join_group(rank: int, world_size: int, port: int, device: torch.device,
               timeout_s: float = COLLECTIVE_TIMEOUT_S) -> ParallelContext:
    """Join the group as `rank` of `world_size` (blocks until every rank has joined, at most `timeout_s`)."""
    if dist.is_initialized():
        raise DeepInferError("this process already runs a tensor-parallel engine; one per process")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return ParallelContext(rank, world_size, control)


def leave_group(control_group=None, synchronize: bool = True) -> None:
    """Leave the group (idempotent). `synchronize`: first wait, at most LEAVE_TIMEOUT_S, until every rank is
    leaving (a monitored barrier over the gloo `control_group`, the default group when None), so that no rank
    closes its connections while a peer still has an operation on them: gloo ends that peer's process with
    std::terminate. Where a rank is known to be gone the wait is pointless: synchronize=False."""
    if not dist.is_initialized():
        return
    if synchronize:
        with contextlib.suppress(RuntimeError):  # a peer gone meanwhile: leave all the same
            dist.monitored_barrier(group=control_group, timeout=timedelta(seconds=LEAVE_TIMEOUT_S))
    dist.destroy_process_group()
