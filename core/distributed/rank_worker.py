"""A tensor-parallel rank other than 0: load its shard, then compute what rank 0 announces until it says stop.

Started by rank 0 (core/distributed/driver.py) as `python -m deepinfer.core.distributed.rank_worker RANK
WORLD_SIZE PORT THREADS CONFIG_JSON`: a process of its own (not a multiprocessing child, so an engine core that
is itself a daemon process can start its ranks). It runs no scheduler, KV manager or sampler: each step it
receives the step's inputs (core/distributed/step_message.py), runs its shard's forward on its own KV pool, and
joins rank 0's collectives (all-reduces, the vocabulary gather). Its load succeeds or fails together with the
other ranks' (`load_together`). It runs in a session of its own, so a terminal's Ctrl-C reaches rank 0 alone,
which stops it (STOP; a broken group or a collective timed out ends this rank with status 1, and so does rank
0's process being gone, whatever this rank is doing: `exit_with_parent`).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from deepinfer.core.config import EngineConfig
from deepinfer.core.distributed.parallel_context import ParallelContext
from deepinfer.core.distributed.process_group import join_group, leave_group
from deepinfer.core.distributed.step_message import CACHE, FORWARD, LOGITS, STOP, StepChannel, cache_blocks
from deepinfer.core.engine.worker.backends import choose_attention_backend
from deepinfer.core.engine.worker.startup import DTYPES, resolve_dtype
from deepinfer.core.errors import DeepInferError
from deepinfer.core.kv.cache import QUANTIZATIONS, STORAGE_DTYPES, KVCache
from deepinfer.core.models.loader import LoadedModel, load_model

PARENT_CHECK_S = 1.0


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU from the configured one, or the CPU."""
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    first = torch.device(config.device if config.device != "auto" else "cuda")
    return torch.device("cuda", (first.index or 0) + rank)


def load_together(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                  parallel: ParallelContext) -> LoadedModel | None:
    """This rank's shard; every rank learns whether all loaded. Rank 0 raises the first rank's error, the other
    ranks return None when any failed (theirs is printed)."""
    loaded, error = None, None
    try:
        loaded = load_model(config, device, dtype, parallel)
    except Exception as err:  # noqa: BLE001 -- reported to rank 0, which raises it
        error = f"{type(err).__name__}: {err}"
        if not parallel.is_driver:
            traceback.print_exc()
    errors: list[str | None] = [None] * parallel.world_size
    dist.all_gather_object(errors, error, group=parallel.control_group)
    failed = [(rank, message) for rank, message in enumerate(errors) if message is not None]
    if failed and parallel.is_driver:
        rank, message = failed[0]
        raise DeepInferError(f"tensor-parallel rank {rank} could not load the model: {message}")
    return None if failed else loaded


def kv_pool(config: EngineConfig, spec, num_blocks: int, dtype: torch.dtype, device: torch.device) -> KVCache:
    """The rank's KV pool of `num_blocks` blocks, its own KV heads, the storage start-up gives rank 0's."""
    quantized = config.kv_cache_dtype if config.kv_cache_dtype in QUANTIZATIONS else None
    return KVCache(spec.num_layers, num_blocks, config.block_size, spec.num_kv_heads, spec.head_dim,
                   DTYPES.get(config.kv_cache_dtype, dtype), device, quantized=quantized)


def serve_rank(config: EngineConfig, parallel: ParallelContext, device: torch.device) -> None:
    dtype = resolve_dtype(config.dtype, device)
    loaded = load_together(config, device, dtype, parallel)  # as rank 0 loads: outside inference mode
    if loaded is None:
        return
    model = loaded.model
    quantized = config.kv_cache_dtype if config.kv_cache_dtype in QUANTIZATIONS else None
    storage = STORAGE_DTYPES.get(quantized, DTYPES.get(config.kv_cache_dtype, dtype))
    model.attention_backend = choose_attention_backend(config.attention_backend, device, dtype, model.spec,
                                                       storage, config.block_size)
    with torch.inference_mode():
        _follow(config, model, device, dtype)


def _follow(config: EngineConfig, model, device: torch.device, dtype: torch.dtype) -> None:
    """Compute what rank 0 announces until it sends STOP."""
    spec = model.spec
    channel = StepChannel(device, model.parallel.control_group)
    kv_cache = None
    while True:
        header = channel.receive_header()
        kind = header[0]
        if kind == STOP:
            return
        if kind == CACHE:
            kv_cache = None  # the old pool's memory first
            kv_cache = kv_pool(config, spec, cache_blocks(header), dtype, device)
        elif kind == FORWARD:
            input_ids, positions, meta = channel.receive_forward(header)
            model(input_ids, positions, meta, kv_cache)
        elif kind == LOGITS:
            model.compute_logits(channel.receive_logits(header, spec.hidden_size, dtype))
        else:
            raise DeepInferError(f"unknown tensor-parallel message {kind}")


def exit_with_parent(parent: int) -> None:
    """End this process once rank 0's (its parent) is gone, whatever it is doing: loading, or waiting for a peer
    that will never come (a rank 0 killed before the group formed)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="deepinfer-rank-parent", daemon=True).start()


def main(argv: list[str]) -> int:
    exit_with_parent(os.getppid())
    rank, world_size, port, threads = map(int, argv[:4])
    config = EngineConfig(**json.loads(argv[4]))
    device = rank_device(config, rank)
    if device.type == "cpu":
        torch.set_num_threads(threads)
    try:
        parallel = join_group(rank, world_size, port, device)
        try:
            serve_rank(config, parallel, device)
        except BaseException:
            leave_group(synchronize=False)
            raise
        leave_group(parallel.control_group)  # beside rank 0, which leaves once it has sent the stop
    except (RuntimeError, DeepInferError) as err:  # the group broke: rank 0 reports why
        print(f"deepinfer tensor-parallel rank {rank}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
