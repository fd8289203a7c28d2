"""AsyncEngine: the LLMEngine in a background thread, feeding asyncio streams (server, chat, bench).

    engine = AsyncEngine(EngineConfig(...))          # loads the model (blocking)
    await engine.start()                             # starts the engine thread
    stream = engine.add_request(prompt, params)      # raises QueueFullError / PromptTooLongError /
                                                     # InvalidRequestError at once
    async for out in stream: ...                     # RequestOutput snapshots; the last has finished=True
    stream.abort()                                   # frees the request's blocks within one engine step
    await engine.shutdown()

The engine thread owns the LLMEngine. Callers only validate and tokenize on their own thread
(`make_request_group`) and hand requests and aborts over through an inbox; the thread takes the
inbox before each step and posts each step's outputs to the streams with
`loop.call_soon_threadsafe`. A failing step fails its own requests (see LLMEngine.step); the
thread itself survives any exception and logs it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable

from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.frontend.outputs import PendingOutputs, RequestOutput
from deepinfer.core.engine.llm_engine import LLMEngine
from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.engine.stats import IterationStats
from deepinfer.core.errors import EngineDeadError, InvalidRequestError, QueueFullError

logger = logging.getLogger(__name__)


class RequestStream:
    """The outputs of one request, as an async iterator; ends after the output with finished=True.

    Outputs the reader has not taken yet are merged into one (PendingOutputs): a reader that falls
    behind gets everything since its last read in its next output, and a stalled one costs memory
    linear in the tokens generated, not a snapshot per step."""

    def __init__(self, request_id: str, engine: AsyncEngine) -> None:
        self.request_id = request_id
        self._engine = engine
        self._pending = PendingOutputs()
        self._error: BaseException | None = None  # handed over after the pending output
        self._arrived = asyncio.Event()
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self._pending and self._error is None:
            self._arrived.clear()
            await self._arrived.wait()
        if not self._pending:
            self.finished = True
            raise self._error
        output = self._pending.take()
        if output.finished:
            self.finished = True
        return output

    def abort(self) -> None:
        """Stop generating; the stream still ends with a finish_reason "abort" output."""
        if not self.finished:
            self._engine.abort(self.request_id)

    def _put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
        else:
            self._pending.add(item)
        self._arrived.set()


class AsyncEngine:
    def __init__(self, config: EngineConfig, loaded_model=None) -> None:
        """`loaded_model`: a core.models.loader.LoadedModel to reuse instead of loading `config.model`
        (a benchmark sweeping engine settings loads the weights once)."""
        self.engine = LLMEngine(config, loaded_model)
        self.config = config
        self.tokenizer = self.engine.tokenizer
        self.spec = self.engine.spec
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self.sampling_defaults = self.engine.sampling_defaults  # what the server and chat fill unset fields with
        self.grammars = self.engine.grammars  # structured outputs' compiler (thread-safe)
        self._streams: dict[str, RequestStream] = {}
        self._inbox: list = []  # RequestGroups to add, in arrival order
        self._aborts: list[str] = []
        self._wakeup = threading.Condition()
        self._listeners: list[Callable[[IterationStats], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: BaseException | None = None

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    cache_salt: str | None = None) -> RequestStream:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop stopped: {self._dead}")
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")
        if self._thread is None:
            raise EngineDeadError("the engine is not running; call `await engine.start()` first")
        group = self.engine.make_request_group(prompt, params, request_id, cache_salt)
        with self._wakeup:
            if group.request_id in self._streams:
                raise InvalidRequestError(f"request id {group.request_id!r} is already in use")
            queued = self.engine.scheduler.num_waiting + sum(len(g.samples) for g in self._inbox)
            if queued + len(group.samples) > self.config.max_waiting_requests:
                raise QueueFullError(
                    f"the waiting queue is full ({self.config.max_waiting_requests} requests); retry later")
            stream = RequestStream(group.request_id, self)
            self._streams[group.request_id] = stream
            self._inbox.append(group)
            self._wakeup.notify()
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """add_request + iterate; leaving the loop early (break, cancel) aborts the request."""
        stream = self.add_request(prompt, params, request_id, cache_salt)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        with self._wakeup:
            self._aborts.append(request_id)
            self._wakeup.notify()

    def add_stats_listener(self, listener: Callable[[IterationStats], None]) -> None:
        """`listener(IterationStats)` is called from the engine thread after every step."""
        self._listeners.append(listener)

    def read_health(self) -> dict:
        """The engine's state now; call it on the engine thread (a stats listener) for a consistent one."""
        return self.engine.health()

    def health(self) -> dict:
        health = self.engine.health()
        health["engine_alive"] = self.is_alive
        return health

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    async def shutdown(self) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        for stream in list(self._streams.values()):
            stream._put(EngineDeadError("the engine was shut down"))
        self._streams.clear()

    # The engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._wakeup:
                    while not (self._inbox or self._aborts or self._stopping
                               or self.engine.has_unfinished_requests()):
                        self._wakeup.wait()
                    if self._stopping:
                        return
                    inbox, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, []
                try:
                    self._iterate(inbox, aborts)
                except Exception:  # a bug outside any one step: log it and keep serving
                    logger.exception("engine loop iteration failed")
        except BaseException as err:  # the thread is going down: fail every waiting stream
            self._dead = err
            logger.exception("the engine thread died")
            self._post_all(EngineDeadError(f"the engine loop stopped: {type(err).__name__}: {err}"))
            raise

    def _iterate(self, inbox: list, aborts: list[str]) -> None:
        deliveries: list[tuple[str, RequestOutput | BaseException]] = []
        for group in inbox:
            try:
                self.engine.add_request_group(group)
            except (QueueFullError, InvalidRequestError) as err:
                deliveries.append((group.request_id, err))
        for request_id in aborts:
            deliveries += [(out.request_id, out) for out in self.engine.abort(request_id)]
        outputs, stats = self.engine.step()
        deliveries += [(out.request_id, out) for out in outputs]
        self._post(deliveries)
        for listener in self._listeners:
            try:
                listener(stats)
            except Exception:  # a listener's bug must not stop the engine
                logger.exception("stats listener %r failed", listener)

    def _post(self, deliveries: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand items to their streams with one event-loop wake-up per step."""
        puts = []
        with self._wakeup:
            for request_id, item in deliveries:
                stream = self._streams.get(request_id)
                if stream is None:
                    continue
                if isinstance(item, BaseException) or item.finished:
                    del self._streams[request_id]
                puts.append((stream, item))
        if puts:
            self._loop.call_soon_threadsafe(_put_all, puts)

    def _post_all(self, error: BaseException) -> None:
        try:
            self._post([(request_id, error) for request_id in list(self._streams)])
        except RuntimeError:  # the event loop is already closed
            pass


def _put_all(puts: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in puts:
        stream._put(item)
