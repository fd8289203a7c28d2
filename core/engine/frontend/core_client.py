"""EngineCoreClient: the front end's side of an engine core in its own process (core_process.py).

The same surface as AsyncEngine (add_request -> RequestStream, abort, stats listeners, health,
start, shutdown), so the server, chat and the benchmarks take either. The front end keeps what it
can do without the model: validation and tokenization (core/engine/frontend/request_checks.py, so bad input
is refused at once on the caller's thread), grammar compilation for validation, chat templates,
metrics. The engine process sends each step's outputs and IterationStats; a thread here hands them
to the streams (one event-loop wake-up per step) and to the stats listeners, so /metrics counts
exactly what the engine did.

An engine process that dies (killed, crashed) is noticed within POLL_MS: every open stream ends with
EngineDeadError (a 503 on the server), new requests are refused, and `on_dead` callbacks run (the
server stops and exits non-zero). `shutdown` asks the engine to stop, and kills it past
SHUTDOWN_TIMEOUT_S; the process is a daemon, so it never outlives the front end either.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.core_ipc import ABORT, ADD, FAILED, OUTPUTS, READY, SHUTDOWN, MessageCodec
from deepinfer.core.engine.frontend.async_engine import RequestStream, _put_all
from deepinfer.core.engine.frontend.request_checks import check_request
from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.engine.sched.core_process import run_engine_core
from deepinfer.core.engine.stats import IterationStats
from deepinfer.core.errors import DeepInferError, EngineDeadError, InvalidRequestError
from deepinfer.core.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often the output thread checks that the engine process is alive
SHUTDOWN_TIMEOUT_S = 10.0


class EngineCoreClient:
    def __init__(self, config: EngineConfig) -> None:
        """Starts the engine process and waits until its model is loaded (blocking, as AsyncEngine's
        constructor). Raises DeepInferError with the engine's reason when it cannot start."""
        import torch
        import zmq

        self.config = config
        self._socket_dir = tempfile.TemporaryDirectory(prefix="deepinfer-engine-")
        input_address = f"ipc://{Path(self._socket_dir.name) / 'input'}"
        output_address = f"ipc://{Path(self._socket_dir.name) / 'output'}"
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.bind(input_address)
        self._output = self._context.socket(zmq.PULL)
        self._output.bind(output_address)
        self._send_lock = threading.Lock()  # a ZeroMQ socket is not thread-safe; callers come from many
        self._send_codec, self._recv_codec = MessageCodec(), MessageCodec()
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(config, input_address, output_address, torch.get_num_threads()), name="deepinfer-engine-core",
            daemon=True)
        self.process.start()
        ready = self._wait_ready()
        self.tokenizer = ready["tokenizer"]
        self.spec = ready["spec"]
        self.model_name = ready["model_name"]
        self.max_model_len = ready["max_model_len"]
        self.sampling_defaults = ready["sampling_defaults"]
        self._health = ready["health"]
        self.grammars = GrammarCompiler(self.tokenizer, self.spec.vocab_size, frozenset(ready["eos_token_ids"]))
        self._streams: dict[str, RequestStream] = {}
        self._streams_lock = threading.Lock()
        self._listeners: list[Callable[[IterationStats], None]] = []
        self._dead_callbacks: list[Callable[[], None]] = []
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: BaseException | None = None

    def _wait_ready(self) -> dict:
        while not self._output.poll(POLL_MS):
            if not self.process.is_alive():
                self._close()
                raise DeepInferError(f"the engine process exited while starting (exit code {self.process.exitcode})")
        kind, payload = self._recv_codec.decode(self._output.recv())
        if kind != READY:
            self.process.join(SHUTDOWN_TIMEOUT_S)
            self._close()
            raise DeepInferError(payload if kind == FAILED else f"unexpected first engine message {kind!r}")
        return payload

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._receive, name="deepinfer-engine-client", daemon=True)
        self._thread.start()

    # Requests ------------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    cache_salt: str | None = None) -> RequestStream:
        if self._dead is not None:
            raise EngineDeadError(f"the engine process stopped: {self._dead}")
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")
        if self._thread is None:
            raise EngineDeadError("the engine is not running; call `await engine.start()` first")
        prompt_text, token_ids, params = check_request(
            prompt, params, self.tokenizer, self.spec.vocab_size, self.max_model_len,
            self.config.max_waiting_requests, cache_salt)
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)  # a bad grammar is refused here, at once
        request_id = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
        with self._streams_lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            stream = RequestStream(request_id, self)
            self._streams[request_id] = stream
        self._send(ADD, (request_id, prompt_text, token_ids, params, cache_salt))
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       cache_salt: str | None = None):
        """add_request + iterate; leaving the loop early (break, cancel) aborts the request."""
        stream = self.add_request(prompt, params, request_id, cache_salt)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        if self._dead is None and not self._stopping:
            self._send(ABORT, request_id)

    def add_stats_listener(self, listener: Callable[[IterationStats], None]) -> None:
        """`listener(IterationStats)` is called from the client's receiving thread after every engine step."""
        self._listeners.append(listener)

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
            self._send(SHUTDOWN)
            await asyncio.to_thread(self.process.join, SHUTDOWN_TIMEOUT_S)
        if self.process.is_alive():
            logger.warning("the engine process did not stop in %.0f s; killing it", SHUTDOWN_TIMEOUT_S)
            self.process.kill()
            await asyncio.to_thread(self.process.join)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._fail_all(EngineDeadError("the engine was shut down"))
        self._close()

    # The receiving thread ------------------------------------------------------------------------

    def _send(self, kind: str, payload=None) -> None:
        with self._send_lock:
            self._input.send(self._send_codec.encode(kind, payload))

    def _receive(self) -> None:
        while True:
            if not self._output.poll(POLL_MS):
                if self.process.is_alive():
                    continue
                if not self._stopping:
                    self._die(f"the engine process exited (exit code {self.process.exitcode})")
                return
            kind, payload = self._recv_codec.decode(self._output.recv())
            if kind != OUTPUTS:
                continue
            deliveries, stats, health = payload
            if health is not None:
                self._health = health
            self._post(deliveries)
            if stats is None:
                continue
            for listener in self._listeners:
                try:
                    listener(stats)
                except Exception:  # a listener's bug must not stop the outputs
                    logger.exception("stats listener %r failed", listener)

    def _post(self, deliveries) -> None:
        if self._loop is None:  # never started: no stream was handed out
            return
        puts = []
        with self._streams_lock:
            for request_id, item in deliveries:
                stream = self._streams.get(request_id)
                if stream is None:
                    continue
                if isinstance(item, BaseException) or item.finished:
                    del self._streams[request_id]
                puts.append((stream, item))
        if puts:
            self._loop.call_soon_threadsafe(_put_all, puts)

    def _die(self, reason: str) -> None:
        self._dead = EngineDeadError(reason)
        logger.error("%s; failing %d open requests", reason, len(self._streams))
        self._fail_all(EngineDeadError(reason))
        for callback in self._dead_callbacks:
            try:
                callback()
            except Exception:
                logger.exception("engine-death callback %r failed", callback)

    def _fail_all(self, error: BaseException) -> None:
        with self._streams_lock:
            deliveries = [(request_id, error) for request_id in self._streams]
        try:
            self._post(deliveries)
        except RuntimeError:  # the event loop is already closed
            pass

    def _close(self) -> None:
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._context.term()
        self._socket_dir.cleanup()
