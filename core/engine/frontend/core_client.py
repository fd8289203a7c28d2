"""EngineCoreClient: the front end's side of an engine core in its own process (core_process.py).

The same surface as AsyncEngine (add_request -> RequestStream, abort, stats listeners, health,
start, shutdown; both are EngineFrontends, core/engine/frontend/engine_frontend.py), so the server,
chat, `LLM` and the benchmarks take either. The front end keeps what it can do without the model:
validation and tokenization (core/engine/frontend/request_checks.py, so bad input is refused at once on
the caller's thread), grammar compilation for validation, chat templates, metrics, and the output
processing: the engine process sends each step's sampled token ids, logprobs and finishes
(core/engine/core_outputs.py) with its IterationStats, and a thread here applies them to its own view
of each sample and runs the OutputProcessor (detokenization, stop strings, snapshots, token timings),
off the engine's loop. A stop string (or a failed detokenization) it finds ends the sample here at
once and goes to the engine as FINISH; the tokens the engine computed for it meanwhile are dropped
and taken out of the step's generation count, so the outputs, and /metrics, are what the in-process
engine gives.

An engine process that dies (killed, crashed) is noticed within POLL_MS: every open stream ends with
EngineDeadError (a 503 on the server), new requests are refused, and `on_dead` callbacks run (the
server stops and exits non-zero). `shutdown` asks the engine to stop, and kills it past
SHUTDOWN_TIMEOUT_S; the process is a daemon, so it never outlives the front end either.

A client either starts an engine process of its own (the default), or attaches to one that another
process started for several clients (`sockets` and `engine_pid`: one of the API servers of
`serve --api-server-count N`, core/server/api_servers.py). An attached client binds its own sockets,
prefixes the ids of its requests with its index (so ids are unique across the engine's clients),
watches the engine's pid, and at shutdown only tells the engine it is done: the engine stops when
all its clients are, and the process that started it waits for it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import Callable

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
    client_sockets,
)
from deepinfer.core.engine.core_outputs import apply_core_outputs, finish_sample
from deepinfer.core.engine.frontend.engine_frontend import EngineFrontend
from deepinfer.core.engine.frontend.output_processor import OutputProcessor, RequestGroup
from deepinfer.core.engine.frontend.outputs import RequestOutput
from deepinfer.core.engine.frontend.request_checks import check_request
from deepinfer.core.engine.frontend.request_stream import RequestStream
from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.engine.sched.core_process import run_engine_core
from deepinfer.core.engine.sched.request import RequestStatus, make_samples
from deepinfer.core.engine.stats import IterationStats
from deepinfer.core.errors import DeepInferError, EngineDeadError
from deepinfer.core.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often the output thread checks that the engine process is alive
SHUTDOWN_TIMEOUT_S = 10.0


class EngineProcessWatch:
    """The liveness of an engine process this process did not start (not its child: no exit code)."""

    exitcode = None

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def is_alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        except OSError:  # no /proc: ask the kernel whether the pid exists
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            return True
        return state not in ("Z", "X")  # a zombie has exited; its parent has not reaped it yet


class EngineCoreClient(EngineFrontend):
    thread_name = "deepinfer-engine-client"
    engine_kind = "engine process"

    def __init__(self, config: EngineConfig, sockets: ClientSockets | None = None,
                 engine_pid: int | None = None, cpu_threads: int | None = None) -> None:
        """Starts the engine process (or, given `sockets` and `engine_pid`, attaches to a running one as
        its client `sockets.index`) and waits until its model is loaded (blocking, as AsyncEngine's
        constructor). `cpu_threads`: the engine's torch threads (None: this process's count). Raises
        DeepInferError with the engine's reason when it cannot start."""
        import torch
        import zmq

        super().__init__(config)
        self._owns_engine = sockets is None
        self._socket_dir = tempfile.TemporaryDirectory(prefix="deepinfer-engine-") if self._owns_engine else None
        if sockets is None:
            sockets = client_sockets(self._socket_dir.name, 1)[0]
        self._index = sockets.index
        self._id_prefix = "" if self._owns_engine else f"{sockets.index}:"
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.bind(sockets.input_address)
        self._output = self._context.socket(zmq.PULL)
        self._output.bind(sockets.output_address)
        self._send_lock = threading.Lock()  # a ZeroMQ socket is not thread-safe; callers come from many
        self._send_codec, self._recv_codec = MessageCodec(), MessageCodec()
        if self._owns_engine:
            self.process = multiprocessing.get_context("spawn").Process(
                target=run_engine_core, args=(config, [sockets], cpu_threads or torch.get_num_threads()),
                name="deepinfer-engine-core", daemon=True)
            self.process.start()
        else:
            self.process = EngineProcessWatch(engine_pid)
        ready = self._wait_ready()
        self.tokenizer = ready["tokenizer"]
        self.spec = ready["spec"]
        self.model_name = ready["model_name"]
        self.max_model_len = ready["max_model_len"]
        self.sampling_defaults = ready["sampling_defaults"]
        self.weights = ready["weights"]  # how the engine's model holds its weights (LLMEngine.weight_summary)
        self.eos_token_ids = frozenset(ready["eos_token_ids"])
        self._health = ready["health"]
        self.grammars = GrammarCompiler(self.tokenizer, self.spec.vocab_size, self.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._outputs_lock = threading.Lock()  # the output processor: callers add and abort, the thread steps
        self._dead_callbacks: list[Callable[[], None]] = []
        self._ids = itertools.count()

    def _wait_ready(self) -> dict:
        while not self._output.poll(POLL_MS):
            if not self.process.is_alive():
                self._close()
                raise DeepInferError(f"the engine process exited while starting{self._exit_code()}")
        kind, payload = self._recv_codec.decode(self._output.recv())
        if kind != READY:
            if self._owns_engine:
                self.process.join(SHUTDOWN_TIMEOUT_S)
            self._close()
            raise DeepInferError(payload if kind == FAILED else f"unexpected first engine message {kind!r}")
        return payload

    # Requests ------------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    cache_salt: str | None = None) -> RequestStream:
        self._check_open()
        return self.add_request_group(self.make_request_group(prompt, params, request_id, cache_salt))

    def make_request_group(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                           cache_salt: str | None = None) -> RequestGroup:
        """Validate and tokenize one request (thread-safe), as LLMEngine's of the same name; its samples are
        this side's view of the engine's. Raises InvalidRequestError, PromptTooLongError."""
        prompt_text, token_ids, params = check_request(
            prompt, params, self.tokenizer, self.spec.vocab_size, self.max_model_len,
            self.config.max_waiting_requests, cache_salt)
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)  # a bad grammar is refused here, at once
        request_id = self._id_prefix + (str(request_id) if request_id is not None else f"req-{next(self._ids)}")
        samples = make_samples(request_id, token_ids, params, eos_token_ids=self.eos_token_ids,
                               cache_salt=cache_salt, arrival_time=time.monotonic())
        return RequestGroup(request_id, prompt_text, token_ids, params, samples)

    def add_request_group(self, group: RequestGroup) -> RequestStream:
        """Send a validated request to the engine. -> its stream (EngineDeadError, InvalidRequestError
        for an id in use raise at once; a full queue comes as the stream's QueueFullError)."""
        self._check_open()
        stream = self._open_stream(group.request_id)
        with self._outputs_lock:
            self.output_processor.add(group)
        self._send(ADD, (self._index, group.request_id, group.prompt_token_ids, group.params, group.samples[0].cache_salt))
        return stream

    def abort(self, request_id: str) -> None:
        if self._dead is not None or self._stopping:
            return
        with self._outputs_lock:
            group = self.output_processor.groups.get(request_id)
            sample_ids = [] if group is None else [s.request_id for s in group.samples if not s.is_finished]
        if sample_ids:
            self._send(ABORT, sample_ids)

    @property
    def num_open_requests(self) -> int:
        """The requests sent through this client whose streams have not ended."""
        return len(self._streams)

    def holds_request(self, request_id: str) -> bool:
        return request_id in self._streams

    def add_dead_callback(self, callback: Callable[[], None]) -> None:
        """`callback()` runs (on the receiving thread) once, if the engine process dies."""
        self._dead_callbacks.append(callback)

    def read_health(self) -> dict:
        """The engine's latest health snapshot, taken in the engine process after a step."""
        return self._health

    def health(self) -> dict:
        return {**self._health, "engine_alive": self.is_alive}

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self.process.is_alive()

    async def shutdown(self) -> None:
        self._stopping = True
        if self.process.is_alive():
            self._send(SHUTDOWN, self._index)
            if self._owns_engine:
                await asyncio.to_thread(self.process.join, SHUTDOWN_TIMEOUT_S)
        if self._owns_engine and self.process.is_alive():
            logger.warning("the engine process did not stop in %.0f s; killing it", SHUTDOWN_TIMEOUT_S)
            self.process.kill()
            await asyncio.to_thread(self.process.join)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._shut_down()
        self._close()

    # The receiving thread ------------------------------------------------------------------------

    def _send(self, kind: str, payload=None) -> None:
        with self._send_lock:
            self._input.send(self._send_codec.encode(kind, payload))

    def _exit_code(self) -> str:
        return "" if self.process.exitcode is None else f" (exit code {self.process.exitcode})"

    def _run(self) -> None:
        while True:
            if self._stopping and not self._owns_engine:  # the engine goes on for its other clients
                return
            if not self._output.poll(POLL_MS):
                if self.process.is_alive():
                    continue
                if not self._stopping:
                    self._die(f"the engine process exited{self._exit_code()}")
                return
            kind, payload = self._recv_codec.decode(self._output.recv())
            if kind != OUTPUTS:
                continue
            refused, step, stats, health = payload
            if health is not None:
                self._health = health
            try:
                deliveries = self._process(refused, step, stats)
            except Exception:  # a bug here must not stop the outputs of later steps
                logger.exception("processing the engine's outputs failed")
                continue
            self._post(deliveries)
            self._notify_listeners(stats)

    def _process(self, refused: list, step: tuple, stats: IterationStats
                 ) -> list[tuple[str, RequestOutput | BaseException]]:
        """One engine step's outputs -> [(request id, RequestOutput or error)]; sends FINISH for the samples
        a stop string (or a failed detokenization) ended here."""
        processor, finishes = self.output_processor, []
        with self._outputs_lock:
            for request_id, _ in refused:
                processor.remove(request_id)
            sampled, touched, discarded = apply_core_outputs(step, processor.samples)
            stats.num_generation_tokens -= discarded  # computed after the sample ended: never an output
            stopped, failed = processor.append_tokens(sampled, stats)
            now = time.monotonic()
            for sample, stop in stopped:
                finish_sample(sample, RequestStatus.FINISHED_STOPPED, now, stop_reason=stop)
                finishes.append((sample.request_id, RequestStatus.FINISHED_STOPPED.value, stop, None))
            for sample, message in failed:
                finish_sample(sample, RequestStatus.FINISHED_ERROR, now, error=message)
                finishes.append((sample.request_id, RequestStatus.FINISHED_ERROR.value, None, message))
                touched.append(sample)
            outputs = processor.make_outputs(touched, stats)
        if finishes:
            self._send(FINISH, finishes)
        return list(refused) + [(output.request_id, output) for output in outputs]

    def _die(self, reason: str) -> None:
        self._dead = EngineDeadError(reason)
        logger.error("%s; failing %d open requests", reason, len(self._streams))
        self._fail_all(EngineDeadError(reason))
        for callback in self._dead_callbacks:
            try:
                callback()
            except Exception:
                logger.exception("engine-death callback %r failed", callback)

    def _close(self) -> None:
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._context.term()
        if self._socket_dir is not None:
            self._socket_dir.cleanup()
