"""The engine core in its own process: `run_engine_core` is that process's main function.

It builds the LLMEngine (model, KV pool, CUDA graphs), says READY to every front end with what it
needs, then loops: while a request is queued, running or in flight it takes whatever input has
arrived without waiting and runs a step, sending that step's outputs; when idle it blocks on its
input socket, so an idle engine burns no core. The engine has no output processor here
(LLMEngine's `detokenize=False`): what crosses to the front end are each step's sampled token ids,
logprobs and finishes (core/engine/core_outputs.py); the front end detokenizes, matches stop
strings, builds the outputs, and sends back FINISH for the samples it ended, which the loop frees
before its next step.

Several front ends (`serve --api-server-count N`) share one engine. Each sample is owned by the
front end that added it: a step's outputs are split by owner, and each front end gets only its own
samples' tokens and finishes, and the generation tokens of those in its IterationStats. The figures
of the whole engine in a step (prefix-cache queries and hits, preemptions, computed prompt tokens)
go to exactly one front end, the first one the step is sent to, so the front ends' metrics sum to
the engine's; the gauges (running, waiting, KV usage) go to all it is sent to. A front end with no
sample in a step hears of it only when the health dict is due (every HEALTH_INTERVAL_S, and when the
engine goes idle), so its /health and gauges stay current without a wake-up per step.

A front end that takes no outputs (its queue of ZeroMQ's high-water mark is full: its process died or
hangs) is dropped and its requests aborted, rather than blocking the step loop for the others.

It ends once every front end has sent SHUTDOWN (or was dropped), or when the process that started it
is gone (its parent id changes: a killed front end or supervisor leaves no orphan engine). SIGINT is ignored
here: Ctrl-C reaches the whole process group, and the front end (or the supervisor of several)
stops the engine in order.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time

from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.core_ipc import (
    ABORT,
    ADD,
    FAILED,
    FINISH,
    OUTPUTS,
    READY,
    SHUTDOWN,
    ClientSockets,
    MessageCodec,
)
from deepinfer.core.engine.core_outputs import core_outputs
from deepinfer.core.engine.interpreter import tune_for_serving
from deepinfer.core.engine.sched.request import FINISHED_STATUSES, RequestStatus
from deepinfer.core.engine.stats import IterationStats
from deepinfer.core.errors import InvalidRequestError, QueueFullError

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 0.05  # as the in-process /health snapshots
PARENT_CHECK_MS = 1000  # an idle engine looks at its parent this often


def run_engine_core(config: EngineConfig, clients: list[ClientSockets], cpu_threads: int) -> None:
    """Serve the front ends `clients` (index i at position i). `cpu_threads`: torch's CPU thread count,
    the front end's (a spawned process starts at torch's default)."""
    import torch
    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(cpu_threads)
    parent = os.getppid()
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    for client in clients:
        inputs.connect(client.input_address)
    outputs = []
    for client in clients:
        outputs.append(context.socket(zmq.PUSH))
        outputs[-1].connect(client.output_address)
    codec = MessageCodec()
    try:
        try:
            from deepinfer.core.engine.llm_engine import LLMEngine

            engine = LLMEngine(config, detokenize=False)
        except Exception as err:  # noqa: BLE001 -- the front ends report it
            failed = codec.encode(FAILED, f"{type(err).__name__}: {err}")
            for output in outputs:
                output.send(failed)
            return
        ready = codec.encode(READY, {
            "tokenizer": engine.tokenizer, "spec": engine.spec, "model_name": engine.model_name,
            "max_model_len": engine.max_model_len, "sampling_defaults": engine.sampling_defaults,
            "eos_token_ids": engine.eos_token_ids, "weights": engine.weight_summary(), "health": engine.health()})
        for output in outputs:
            output.send(ready)
        tune_for_serving()
        try:
            _serve(engine, inputs, outputs, codec, parent)
        finally:
            engine.close()  # a tensor-parallel engine's other ranks
    finally:
        inputs.close(linger=0)
        for output in outputs:
            output.close(linger=1000)
        context.term()


def _serve(engine, inputs, outputs: list, codec: MessageCodec, parent: int) -> None:
    import zmq

    single = len(outputs) == 1
    owners: dict[str, int] = {}  # sample id -> the front end that added it, while the engine holds it
    open_clients = set(range(len(outputs)))
    health_at = 0.0
    while True:
        if not engine.has_unfinished_requests() and not inputs.poll(PARENT_CHECK_MS):
            if os.getppid() != parent:
                return
            continue
        refused: list[list] = [[] for _ in outputs]
        finished = []
        while inputs.poll(0):
            kind, payload = codec.decode(inputs.recv(zmq.NOBLOCK))
            if kind == SHUTDOWN:
                open_clients.discard(payload)
                if not open_clients:
                    return
            elif kind == ADD:
                client, request_id, token_ids, params, cache_salt = payload
                try:
                    group = engine.make_request_group(token_ids, params, request_id, cache_salt)
                    engine.add_request_group(group)
                except (QueueFullError, InvalidRequestError) as err:
                    refused[client].append((request_id, err))
                    continue
                if not single:
                    owners.update((sample.request_id, client) for sample in group.samples)
            elif kind == ABORT:
                finished += engine.finish(payload, RequestStatus.FINISHED_ABORTED)
            elif kind == FINISH:  # the front end has these samples' final outputs already
                for sample_id, reason, stop_reason, error in payload:
                    engine.finish([sample_id], RequestStatus(reason), stop_reason=stop_reason, error=error)
                    owners.pop(sample_id, None)
        touched, stats = engine.core_step()  # also after aborts alone: it reports their finishes
        now = time.monotonic()
        health = None
        if not engine.has_unfinished_requests() or now - health_at >= HEALTH_INTERVAL_S:
            health, health_at = engine.health(), now
        if single:
            outputs[0].send(codec.encode(OUTPUTS, (refused[0], core_outputs(engine.sampled, finished + touched),
                                                   stats, health)))
            continue
        for client, message in _split_by_owner(engine.sampled, finished + touched, owners, refused, stats, health,
                                               open_clients):
            try:
                outputs[client].send(codec.encode(OUTPUTS, message), zmq.NOBLOCK)
            except zmq.Again:  # a full queue: that front end is gone or stuck, and must not stall the others
                logger.error("front end %d takes no outputs; aborting its requests", client)
                _drop_client(engine, client, owners, open_clients)
        if not open_clients:
            return


def _drop_client(engine, client: int, owners: dict[str, int], open_clients: set[int]) -> None:
    """Stop serving front end `client`: abort its samples and send it nothing more."""
    open_clients.discard(client)
    samples = [sample_id for sample_id, owner in owners.items() if owner == client]
    engine.finish(samples, RequestStatus.FINISHED_ABORTED)
    for sample_id in samples:
        del owners[sample_id]


def _split_by_owner(sampled: list, touched: list, owners: dict[str, int], refused: list[list],
                    stats: IterationStats, health: dict | None, open_clients: set[int]) -> list[tuple[int, tuple]]:
    """One step's [(front end, its OUTPUTS payload)]: each front end's own samples (a sample the engine
    finished is forgotten in `owners`); the engine-wide counts in the first payload only."""
    num_clients = len(refused)
    sampled_by: list[list] = [[] for _ in range(num_clients)]
    touched_by: list[list] = [[] for _ in range(num_clients)]
    for request in sampled:
        client = owners.get(request.request_id)
        if client is not None:  # None: a token computed after the front end finished the sample
            sampled_by[client].append(request)
    for request in touched:
        client = owners.get(request.request_id)
        if client is not None:
            touched_by[client].append(request)
    for request in touched:
        if request.status in FINISHED_STATUSES:
            owners.pop(request.request_id, None)
    receivers = [client for client in sorted(open_clients)
                 if health is not None or refused[client] or touched_by[client]]
    if not receivers and open_clients:  # the engine-wide counts of a step with no sample (a prefill chunk)
        receivers = [min(open_clients)]
    messages = []
    for client in receivers:
        counts_engine = client == receivers[0]
        client_stats = dataclasses.replace(
            stats, num_generation_tokens=len(sampled_by[client]),
            prefix_cache_queries=stats.prefix_cache_queries if counts_engine else 0,
            prefix_cache_hits=stats.prefix_cache_hits if counts_engine else 0,
            num_preemptions=stats.num_preemptions if counts_engine else 0,
            num_prompt_tokens=stats.num_prompt_tokens if counts_engine else 0)
        messages.append((client, (refused[client], core_outputs(sampled_by[client], touched_by[client]),
                                  client_stats, health)))
    return messages
