"""EngineFrontend: what the two asyncio front ends of the engine share.

AsyncEngine (the engine on a thread of this process) and EngineCoreClient (the engine core in a
process of its own) differ in where the steps run and how requests reach them; the rest is this
class: one background thread (`start`; `_run` is the subclass's loop), the refusal of requests once
the engine is dead or stopping, the registry of open RequestStreams, the hand-over of each step's
outputs to them with one event-loop wake-up per step, the end of every open stream when the engine
dies or stops, and the stats listeners.

Subclasses give `_run` (the thread's loop), `abort`, `add_request` (validation, then `_open_stream`,
then the hand-over to the engine), `is_alive` and `shutdown`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable

from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.frontend.outputs import RequestOutput
from deepinfer.core.engine.frontend.request_stream import RequestStream, put_all
from deepinfer.core.engine.interpreter import restore_after_serving, tune_for_serving
from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.engine.stats import IterationStats
from deepinfer.core.errors import EngineDeadError, InvalidRequestError

logger = logging.getLogger(__name__)


class EngineFrontend:
    thread_name = "deepinfer-engine"
    engine_kind = "engine loop"  # how errors name the engine ("the engine loop stopped: ...")

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._streams: dict[str, RequestStream] = {}
        self._streams_lock = threading.Lock()  # callers' threads open streams, the background thread ends them
        self._listeners: list[Callable[[IterationStats], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: BaseException | None = None

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        tune_for_serving()  # the model (or its client) is built (core/engine/interpreter.py)
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    @property
    def is_alive(self) -> bool:
        raise NotImplementedError

    # Requests ------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        """Raises EngineDeadError unless requests can be taken now."""
        if self._dead is not None:
            raise EngineDeadError(f"the {self.engine_kind} stopped: {self._dead}")
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")
        if self._thread is None:
            raise EngineDeadError("the engine is not running; call `await engine.start()` first")

    def _open_stream(self, request_id: str) -> RequestStream:
        """A new stream for `request_id`; raises InvalidRequestError when one is open under that id."""
        with self._streams_lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            stream = RequestStream(request_id, self)
            self._streams[request_id] = stream
        return stream

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    cache_salt: str | None = None) -> RequestStream:
        raise NotImplementedError

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """add_request + iterate; leaving the loop early (break, cancel) aborts the request."""
        stream = self.add_request(prompt, params, request_id, cache_salt)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def add_stats_listener(self, listener: Callable[[IterationStats], None]) -> None:
        """`listener(IterationStats)` is called from the background thread after every engine step."""
        self._listeners.append(listener)

    # The background thread -----------------------------------------------------------------------

    def _notify_listeners(self, stats: IterationStats) -> None:
        for listener in self._listeners:
            try:
                listener(stats)
            except Exception:  # a listener's bug must not stop the engine or its outputs
                logger.exception("stats listener %r failed", listener)

    def _post(self, deliveries: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand items to their streams with one event-loop wake-up per step; a finished output or an error
        ends its stream."""
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
            self._loop.call_soon_threadsafe(put_all, puts)

    def _shut_down(self) -> None:
        """The end of `shutdown`: every open stream ends, and the interpreter is as before `start`
        (core/engine/interpreter.py)."""
        self._fail_all(EngineDeadError("the engine was shut down"))
        restore_after_serving()

    def _fail_all(self, error: BaseException) -> None:
        """End every open stream with `error`."""
        with self._streams_lock:
            deliveries = [(request_id, error) for request_id in self._streams]
        try:
            self._post(deliveries)
        except RuntimeError:  # the event loop is already closed
            pass
