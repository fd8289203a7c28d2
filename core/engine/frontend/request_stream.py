"""RequestStream: the outputs of one request, as an async iterator, for either engine front end
(core/engine/frontend/engine_frontend.py)."""

from __future__ import annotations

import asyncio

from deepinfer.core.engine.frontend.outputs import PendingOutputs, RequestOutput


class RequestStream:
    """The outputs of one request, as an async iterator; ends after the output with finished=True.

    Outputs the reader has not taken yet are merged into one (PendingOutputs): a reader that falls
    behind gets everything since its last read in its next output, and a stalled one costs memory
    linear in the tokens generated, not a snapshot per step."""

    def __init__(self, request_id: str, engine) -> None:
        """`engine`: the front end whose `abort(request_id)` stops the request."""
        self.request_id = request_id
        self._engine = engine
        self._pending = PendingOutputs()
        self._error: BaseException | None = None  # handed over after the pending output
        self._waiter: asyncio.Future | None = None  # the reader's, while it waits for an item
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        if not self._pending and self._error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter  # `_put` sets it: an item is there when it is done
            finally:
                self._waiter = None
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
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def put_all(puts: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    """Hand each item to its stream (on the event loop: one call per engine step)."""
    for stream, item in puts:
        stream._put(item)
