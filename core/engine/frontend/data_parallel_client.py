"""DataParallelClient: one front end in front of N engine-core processes (`serve --data-parallel-size N`).

Each replica is an EngineCoreClient with an engine process of its own (core_client.py): its own model
copy, KV pool (sized by the config as for one engine) and step loop. Placement: replica i runs on
cuda:i when the config's device is cuda or auto and torch sees at least N GPUs; on the CPU (device
cpu, or auto without a GPU) every replica runs there, with the torch threads split between them.
Fewer GPUs than N, or one named GPU (cuda:K), is refused before any process starts.

A request is validated and tokenized by the replica the ReplicaRouter (replica_router.py) picks: the
least loaded, or the one whose prefix cache holds the prompt's first blocks. Its stream belongs to
that replica, so its outputs, its abort and its finish go there; a request's n samples are one
request, on one replica. The surface is the EngineCoreClient's (the server takes either); stats
listeners and dead callbacks run for every replica (`replicas` lets /metrics label each one's
figures), /health is healthy while every replica is, and a replica that dies ends its own open
streams with EngineDeadError, refuses new requests on all, and runs the dead callbacks (the server
stops and exits non-zero, ending the other replicas' requests as it shuts down). `shutdown` stops
every replica's process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.frontend.core_client import EngineCoreClient
from deepinfer.core.engine.frontend.engine_frontend import EngineFrontend
from deepinfer.core.engine.frontend.replica_router import ReplicaRouter
from deepinfer.core.engine.frontend.request_stream import RequestStream
from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.engine.stats import IterationStats
from deepinfer.core.errors import DeepInferError, EngineDeadError


def replica_devices(device: str, num_replicas: int) -> list[str]:
    """The device of each replica; raises DeepInferError when the machine cannot hold them."""
    import torch

    if device == "cpu":
        return ["cpu"] * num_replicas
    if device not in ("auto", "cuda"):
        raise DeepInferError(f"--data-parallel-size places replica i on cuda:i; use --device cuda, auto or cpu, "
                             f"not {device!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto" and gpus == 0:
        return ["cpu"] * num_replicas
    if gpus < num_replicas:
        raise DeepInferError(f"--data-parallel-size {num_replicas} needs {num_replicas} CUDA GPUs; torch sees {gpus}")
    return [f"cuda:{index}" for index in range(num_replicas)]


class DataParallelClient:
    def __init__(self, config: EngineConfig, num_replicas: int) -> None:
        """Starts the N engine processes at once and waits until every model is loaded (blocking). Raises
        DeepInferError when a replica cannot start (the others are stopped)."""
        import torch

        if config.tensor_parallel_size > 1:
            raise DeepInferError("data_parallel_size > 1 with tensor_parallel_size > 1 is not built: each replica "
                                 "would take the same GPUs")
        devices = replica_devices(config.device, num_replicas)
        cpu_threads = max(1, torch.get_num_threads() // num_replicas) if devices[0] == "cpu" else None
        configs = [dataclasses.replace(config, device=device) for device in devices]
        with ThreadPoolExecutor(num_replicas) as pool:
            futures = [pool.submit(EngineCoreClient, replica_config, cpu_threads=cpu_threads)
                       for replica_config in configs]
        failures = [future.exception() for future in futures if future.exception() is not None]
        if failures:
            for future in futures:
                if future.exception() is None:
                    asyncio.run(future.result().shutdown())
            raise failures[0]
        self.config = config
        self.replicas: list[EngineCoreClient] = [future.result() for future in futures]
        first = self.replicas[0]
        self.tokenizer, self.spec, self.model_name = first.tokenizer, first.spec, first.model_name
        self.max_model_len = min(replica.max_model_len for replica in self.replicas)
        self.sampling_defaults, self.weights = first.sampling_defaults, first.weights
        self.eos_token_ids, self.grammars = first.eos_token_ids, first.grammars
        self.router = ReplicaRouter(num_replicas, config.block_size)
        self._route_lock = threading.Lock()  # callers add from many threads; a pick and its add are one step

    # Requests ------------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    cache_salt: str | None = None) -> RequestStream:
        dead = next((index for index, replica in enumerate(self.replicas) if not replica.is_alive), None)
        if dead is not None:  # the server is going down: no replica takes more
            raise EngineDeadError(f"the engine process of replica {dead} stopped")
        first = self.replicas[0]
        group = first.make_request_group(prompt, params, request_id, cache_salt)  # validation, tokenization
        with self._route_lock:
            loads = [replica.num_open_requests for replica in self.replicas]
            index = self.router.choose(group.prompt_token_ids, cache_salt, loads)
            return self.replicas[index].add_request_group(group)

    generate = EngineFrontend.generate  # add_request + iterate, over this class's add_request

    def abort(self, request_id: str) -> None:
        for replica in self.replicas:
            if replica.holds_request(request_id):
                replica.abort(request_id)

    def add_stats_listener(self, listener: Callable[[IterationStats], None]) -> None:
        """`listener(IterationStats)` runs after every step of every replica (on that replica's thread)."""
        for replica in self.replicas:
            replica.add_stats_listener(listener)

    def add_dead_callback(self, callback: Callable[[], None]) -> None:
        """`callback()` runs once, when the first replica's engine process dies."""
        fired = threading.Event()

        def once() -> None:
            if not fired.is_set():
                fired.set()
                callback()

        for replica in self.replicas:
            replica.add_dead_callback(once)

    # Health and lifetime -------------------------------------------------------------------------

    def read_health(self) -> dict:
        """Replica 0's health dict with the scheduler's and the block pool's counts summed over the
        replicas, and every replica's own under "replicas"."""
        healths = [replica.read_health() for replica in self.replicas]
        summed = {section: _sum_counts([health[section] for health in healths])
                  for section in ("scheduler", "blocks") if section in healths[0]}
        return {**healths[0], **summed, "replicas": healths}

    def health(self) -> dict:
        return {**self.read_health(), "engine_alive": self.is_alive}

    @property
    def is_alive(self) -> bool:
        return all(replica.is_alive for replica in self.replicas)

    async def start(self) -> None:
        for replica in self.replicas:
            await replica.start()

    async def shutdown(self) -> None:
        await asyncio.gather(*(replica.shutdown() for replica in self.replicas))


def _sum_counts(sections: list[dict]) -> dict:
    """One health section per replica -> replica 0's with its counts (the `num_*` and `max_num_*` keys)
    summed, and the block usage of the sum."""
    summed = {key: sum(section[key] for section in sections) if key.startswith(("num_", "max_num_")) else value
              for key, value in sections[0].items()}
    if "usage" in summed and summed.get("num_blocks"):
        summed["usage"] = summed["num_used"] / summed["num_blocks"]
    return summed
