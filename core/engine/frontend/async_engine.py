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
thread itself survives any exception and logs it. The streams, their registry, the thread's start and
the stats listeners are EngineFrontend's (core/engine/frontend/engine_frontend.py), which the
engine-process client shares.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.frontend.engine_frontend import EngineFrontend
from deepinfer.core.engine.frontend.outputs import RequestOutput
from deepinfer.core.engine.frontend.request_stream import RequestStream
from deepinfer.core.engine.llm_engine import LLMEngine
from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.errors import EngineDeadError, InvalidRequestError, QueueFullError

logger = logging.getLogger(__name__)


class AsyncEngine(EngineFrontend):
    def __init__(self, config: EngineConfig, loaded_model=None) -> None:
        """`loaded_model`: a core.models.loader.LoadedModel to reuse instead of loading `config.model`
        (a benchmark sweeping engine settings loads the weights once)."""
        super().__init__(config)
        self.engine = LLMEngine(config, loaded_model)
        self.tokenizer = self.engine.tokenizer
        self.spec = self.engine.spec
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self.sampling_defaults = self.engine.sampling_defaults  # what the server and chat fill unset fields with
        self.grammars = self.engine.grammars  # structured outputs' compiler (thread-safe)
        self._inbox: list = []  # RequestGroups to add, in arrival order
        self._aborts: list[str] = []
        self._wakeup = threading.Condition()

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    cache_salt: str | None = None) -> RequestStream:
        self._check_open()
        group = self.engine.make_request_group(prompt, params, request_id, cache_salt)
        with self._wakeup:
            queued = self.engine.scheduler.num_waiting + sum(len(g.samples) for g in self._inbox)
            if queued + len(group.samples) > self.config.max_waiting_requests:
                raise QueueFullError(
                    f"the waiting queue is full ({self.config.max_waiting_requests} requests); retry later")
            stream = self._open_stream(group.request_id)
            self._inbox.append(group)
            self._wakeup.notify()
        return stream

    def abort(self, request_id: str) -> None:
        with self._wakeup:
            self._aborts.append(request_id)
            self._wakeup.notify()

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
        self._shut_down()

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
            self._fail_all(EngineDeadError(f"the engine loop stopped: {type(err).__name__}: {err}"))
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
        self._notify_listeners(stats)
