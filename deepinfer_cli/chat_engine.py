"""An AsyncEngine (or an engine process's EngineCoreClient) on its own event loop thread, driven from the main thread by `deepinfer chat`.

The main thread keeps the terminal (prompt_toolkit's prompt, printing tokens) and the signals:
Python delivers SIGINT to the main thread only, so Ctrl-C reaches the REPL wherever the engine
is, and while an answer streams it stops that answer (`stream_answer`) instead of the program.
Loading runs on the loop thread too, so Ctrl-C while the model loads is seen at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

_POLL_S = 0.1  # how often the waiting main thread wakes, so signal handlers run promptly


@dataclass
class Answer:
    text: str
    interrupted: bool  # stopped with Ctrl-C
    finish_reason: str | None


class ChatEngine:
    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="deepinfer-chat-loop", daemon=True)
        self._thread.start()
        self.engine = None

    def load(self, config, engine_process: bool = False) -> None:
        """Build and start the AsyncEngine (or, with `engine_process`, the EngineCoreClient of an engine core in
        its own process) on the loop thread (imports too), the main thread only waiting."""

        async def build():
            if engine_process:
                from deepinfer.core.engine.frontend.core_client import EngineCoreClient

                engine = EngineCoreClient(config)
            else:
                from deepinfer.core.engine.frontend.async_engine import AsyncEngine

                engine = AsyncEngine(config)
            await engine.start()
            return engine

        self.engine = self._wait(asyncio.run_coroutine_threadsafe(build(), self._loop))

    def stream_answer(self, prompt_ids: list[int], params, on_text: Callable[[str], None]) -> Answer:
        """Generate one answer, passing each new piece of text to `on_text` as it comes.

        Ctrl-C meanwhile aborts the request; what was generated until then is returned, marked.
        Errors of the request (a prompt too long, the engine gone) are raised here.
        """
        pieces: queue.SimpleQueue = queue.SimpleQueue()
        streams: list = []
        done = object()

        async def produce() -> None:
            try:
                stream = self.engine.add_request(prompt_ids, params)
                streams.append(stream)
                async for output in stream:
                    pieces.put(output.outputs[0])
            except BaseException as err:  # noqa: BLE001 - handed to the main thread, raised there
                pieces.put(err)
            finally:
                pieces.put(done)

        interrupted = threading.Event()

        def abort() -> None:
            if streams:
                streams[0].abort()
            else:  # not added yet: abort as soon as it is
                self._loop.call_soon(abort)

        def on_sigint(signum, frame) -> None:
            if not interrupted.is_set():
                interrupted.set()
                self._loop.call_soon_threadsafe(abort)

        text, finish_reason = "", None
        with sigint_handler(on_sigint):
            asyncio.run_coroutine_threadsafe(produce(), self._loop)
            while True:
                try:
                    item = pieces.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                if item is done:
                    break
                if isinstance(item, BaseException):
                    raise item
                if item.delta_text:
                    on_text(item.delta_text)
                text, finish_reason = item.text, item.finish_reason
        return Answer(text, interrupted.is_set(), finish_reason)

    def shutdown(self) -> None:
        if self.engine is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self.engine.shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)

    @staticmethod
    def _wait(future: Future):
        """future.result(), waking every _POLL_S so a KeyboardInterrupt is raised here at once."""
        while True:
            try:
                return future.result(timeout=_POLL_S)
            except FutureTimeout:
                continue


@contextlib.contextmanager
def sigint_handler(handler) -> Iterator[None]:
    """Run `handler(signum, frame)` on SIGINT inside the block, in place of KeyboardInterrupt."""
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def flush_and_exit(code: int) -> None:
    """Leave now, whatever the loop and engine threads are doing (Ctrl-C while the model loads)."""
    import os

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
