"""The engine core in its own process: `run_engine_core` is that process's main function.

It builds the LLMEngine (model, KV pool, CUDA graphs), says READY with what the front end needs,
then loops: while a request is queued, running or in flight it takes whatever input has arrived
without waiting and runs a step, sending that step's outputs; when idle it blocks on its input
socket, so an idle engine burns no core. The engine has no output processor here (LLMEngine's
`detokenize=False`): what crosses to the front end are each step's sampled token ids, logprobs and
finishes (core/engine/core_outputs.py); the front end detokenizes, matches stop strings,
builds the outputs, and sends back FINISH for the samples it ended, which the loop frees before its next
step.

It ends on SHUTDOWN, when its input socket's peer (the front end) is gone, or when the front-end
process is (its parent id changes: a killed front end leaves no orphan engine). SIGINT is ignored
here: Ctrl-C reaches the whole process group, and the front end stops the engine in order.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.core_ipc import ABORT, ADD, FAILED, FINISH, OUTPUTS, READY, SHUTDOWN, MessageCodec
from deepinfer.core.engine.core_outputs import core_outputs
from deepinfer.core.engine.interpreter import tune_for_serving
from deepinfer.core.engine.sched.request import RequestStatus
from deepinfer.core.errors import InvalidRequestError, QueueFullError

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 0.05  # as the in-process /health snapshots
PARENT_CHECK_MS = 1000  # an idle engine looks at its parent this often


def run_engine_core(config: EngineConfig, input_address: str, output_address: str, cpu_threads: int) -> None:
    """`cpu_threads`: torch's CPU thread count, the front end's (a spawned process starts at torch's default)."""
    import torch
    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(cpu_threads)
    parent = os.getppid()
    context = zmq.Context()
    inputs, outputs = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inputs.connect(input_address)
    outputs.connect(output_address)
    codec = MessageCodec()
    try:
        from deepinfer.core.engine.llm_engine import LLMEngine

        engine = LLMEngine(config, detokenize=False)
    except Exception as err:  # noqa: BLE001 -- the front end reports it
        outputs.send(codec.encode(FAILED, f"{type(err).__name__}: {err}"))
        outputs.close(linger=1000)
        return
    outputs.send(codec.encode(READY, {
        "tokenizer": engine.tokenizer, "spec": engine.spec, "model_name": engine.model_name,
        "max_model_len": engine.max_model_len, "sampling_defaults": engine.sampling_defaults,
        "eos_token_ids": engine.eos_token_ids, "weights": engine.weight_summary(), "health": engine.health()}))
    tune_for_serving()
    try:
        _serve(engine, inputs, outputs, codec, parent)
    finally:
        inputs.close(linger=0)
        outputs.close(linger=1000)
        context.term()


def _serve(engine, inputs, outputs, codec: MessageCodec, parent: int) -> None:
    import zmq

    health_at = 0.0
    while True:
        if not engine.has_unfinished_requests() and not inputs.poll(PARENT_CHECK_MS):
            if os.getppid() != parent:
                return
            continue
        refused, finished = [], []
        while inputs.poll(0):
            kind, payload = codec.decode(inputs.recv(zmq.NOBLOCK))
            if kind == SHUTDOWN:
                return
            if kind == ADD:
                request_id, token_ids, params, cache_salt = payload
                try:
                    engine.add_request_group(engine.make_request_group(token_ids, params, request_id, cache_salt))
                except (QueueFullError, InvalidRequestError) as err:
                    refused.append((request_id, err))
            elif kind == ABORT:
                finished += engine.finish(payload, RequestStatus.FINISHED_ABORTED)
            elif kind == FINISH:  # the front end has these samples' final outputs already
                for sample_id, reason, stop_reason, error in payload:
                    engine.finish([sample_id], RequestStatus(reason), stop_reason=stop_reason, error=error)
        touched, stats = engine.core_step()  # also after aborts alone: it reports their finishes
        step = core_outputs(engine.sampled, finished + touched)
        now = time.monotonic()
        health = None
        if not engine.has_unfinished_requests() or now - health_at >= HEALTH_INTERVAL_S:
            health, health_at = engine.health(), now
        outputs.send(codec.encode(OUTPUTS, (refused, step, stats, health)))
