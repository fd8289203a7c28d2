"""Rank 0 of a tensor-parallel engine: starts the other ranks and stands in for the model in the engine.

`start_tensor_parallel(config, device, dtype)` starts ranks 1..N-1 (core/distributed/rank_worker.py), joins
the process group as rank 0, loads rank 0's shard together with theirs, and returns a LoadedModel whose model
is a TensorParallelDriver around that shard. The engine (scheduler, KV manager, sampler) runs once, here, and
sees an ordinary model: each `forward` first broadcasts the step's inputs, each `compute_logits` the hidden
rows it scores (core/distributed/step_message.py), so every rank runs the same computation on its shard and
the collectives inside it meet; rank 0 gets the gathered logits. The LoadedModel's spec is rank 0's shard's. A KV pool rank 0 has not used before is
announced first, so every rank holds a pool of the same blocks.

A rank that has exited ends the next call with a DeepInferError naming it; one that hangs ends it when the
group's collective timeout passes (core/distributed/process_group.py). `close()` stops the ranks.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

from deepinfer.core.config import EngineConfig
from deepinfer.core.distributed.process_group import free_port, join_group, leave_group
from deepinfer.core.distributed.rank_worker import load_together, rank_device
from deepinfer.core.distributed.step_message import StepChannel
from deepinfer.core.errors import DeepInferError
from deepinfer.core.models.loader import LoadedModel

STOP_TIMEOUT_S = 30.0
EXIT_GRACE_S = 0.5  # after a failed collective: time for a rank whose crash broke it to be seen exited
LOG_TAIL_LINES = 5


class RankProcess:
    """Rank r >= 1's process; its stderr goes to a file of its own, whose end is quoted when it exits."""

    def __init__(self, rank: int, world_size: int, port: int, settings: str) -> None:
        self.rank = rank
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 -- lives as long as the rank; closed by end()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "deepinfer.core.distributed.rank_worker", str(rank), str(world_size), str(port),
             str(torch.get_num_threads()), settings], stderr=self.log, start_new_session=True)

    def exit_report(self) -> str | None:
        """'tensor-parallel rank R exited (status S): the end of its stderr', or None while it runs."""
        if self.process.poll() is None:
            return None
        self.log.seek(0)
        tail = " | ".join(self.log.read().decode(errors="replace").strip().splitlines()[-LOG_TAIL_LINES:])
        return f"tensor-parallel rank {self.rank} exited (status {self.process.returncode})" + (
            f": {tail}" if tail else "")

    def end(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Wait up to `timeout_s` for it to exit, then kill it."""
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def start_tensor_parallel(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    world_size = config.tensor_parallel_size
    if device.type == "cuda" and (device.index or 0) + world_size > torch.cuda.device_count():
        raise DeepInferError(f"tensor_parallel_size {world_size} needs {world_size} GPUs from {device}; "
                             f"torch sees {torch.cuda.device_count()}")
    port = free_port()
    settings = json.dumps(dataclasses.asdict(config), default=str)  # a model path may be a Path
    ranks = [RankProcess(rank, world_size, port, settings) for rank in range(1, world_size)]
    try:
        parallel = join_group(0, world_size, port, rank_device(config, 0) if device.type == "cuda" else device)
    except BaseException:
        for rank in ranks:
            rank.end(timeout_s=0.0)
        raise
    try:
        loaded = load_together(config, device, dtype, parallel)
    except BaseException:
        leave_group(parallel.control_group)  # beside the other ranks, which leave once load_together said it failed
        for rank in ranks:
            rank.end()
        raise
    # The shard's spec: rank 0's head and channel counts (what its KV pool holds), the vocabulary whole.
    driver = TensorParallelDriver(loaded.model, ranks, device, parallel.control_group)
    return dataclasses.replace(loaded, spec=loaded.model.spec, model=driver)


class TensorParallelDriver(nn.Module):
    """The engine's model at TP=N: rank 0's shard (`shard`), whose every call the other ranks join."""

    def __init__(self, shard: nn.Module, ranks: list[RankProcess], device: torch.device, control_group) -> None:
        super().__init__()
        self.shard = shard
        self.ranks = ranks
        self._channel = StepChannel(device, control_group)
        self._control_group = control_group
        self._kv_cache = None  # the pool the other ranks hold a copy of
        self._open = True
        atexit.register(self.close)  # an engine left open still stops its ranks cleanly

    @property
    def spec(self):
        return self.shard.spec

    @property
    def attention_backend(self):
        return self.shard.attention_backend

    @attention_backend.setter
    def attention_backend(self, backend) -> None:
        self.shard.attention_backend = backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata, kv_cache) -> torch.Tensor:
        with self._together():
            if kv_cache is not self._kv_cache:
                self._channel.send_cache(kv_cache.num_blocks)
                self._kv_cache = kv_cache
            self._channel.send_forward(input_ids, positions, attn_metadata)
            return self.shard(input_ids, positions, attn_metadata, kv_cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32, every rank's vocabulary slice gathered here."""
        with self._together():
            self._channel.send_logits(hidden)
            return self.shard.compute_logits(hidden)

    @contextlib.contextmanager
    def _together(self):
        """Around a computation every rank joins: a rank gone, or a collective that failed (a rank that exited,
        one that hung past the timeout), closes the engine, since the ranks are out of step from then on."""
        if not self._open:
            raise DeepInferError("the tensor-parallel engine is closed")
        exited = self._exit_reports()
        if exited:
            self.close(out_of_step=True)
            raise DeepInferError(f"{exited}; the engine cannot go on")
        try:
            yield
        except RuntimeError as err:
            time.sleep(EXIT_GRACE_S)
            exited = self._exit_reports()
            self.close(out_of_step=True)
            raise DeepInferError(f"a tensor-parallel collective failed, the engine is closed: {exited or err}") from err

    def _exit_reports(self) -> str:
        return "; ".join(report for report in map(RankProcess.exit_report, self.ranks) if report is not None)

    def close(self, out_of_step: bool = False) -> None:
        """Stop the other ranks and leave the group (idempotent). `out_of_step`: a computation failed part-way,
        so the ranks may wait in different collectives: they are killed instead of told to stop."""
        if not self._open:
            return
        self._open = False
        atexit.unregister(self.close)
        if out_of_step:
            for rank in self.ranks:
                rank.process.kill()
            leave_group(synchronize=False)
        else:
            self._channel.send_stop()
            leave_group(self._control_group)  # with the ranks, which leave once they have the stop
        for rank in self.ranks:
            rank.end()


def eager(decode_mode: str | None) -> str:
    """A tensor-parallel engine's decode mode: its steps run eagerly (CUDA graphs of the collectives are not built)."""
    if decode_mode not in (None, "eager"):
        raise DeepInferError(f"decode_mode {decode_mode!r} is not built for tensor_parallel_size > 1; it runs eagerly")
    return "eager"
