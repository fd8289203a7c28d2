"""The messages between the front ends and the engine-core process, and their framing.

Each front end (an EngineCoreClient: the one API server, or each of `serve --api-server-count N`)
binds two ZeroMQ sockets over ipc:// (its ClientSockets) and the engine process connects to them:
one PULL socket in the engine connects to every front end's input (ZeroMQ queues their messages
fairly), and one PUSH socket per front end carries that front end's outputs back. The engine
remembers which front end added each request and sends each step's outputs of a request only to
it. One message is one ZeroMQ frame, msgpack-encoded by msgspec as `[kind, payload]`. A payload
that is not a plain string (request ids) travels as a msgpack extension holding its pickle:
SamplingParams, RequestOutput, IterationStats and the tokenizer are Python objects that must come
back as themselves (msgspec would turn a dataclass into a dict), as vLLM V1 frames the Python
objects of its engine-core messages.

Front end -> engine: ADD (front end index, request id, prompt token ids, params, cache salt), ABORT
(the request's sample ids), FINISH ([(sample id, finish reason, stop reason, error)]: samples the
front end finished, on a stop string or a detokenization error), SHUTDOWN (front end index: it is
done; the engine stops once every front end is). Engine -> each front end: READY (what the front
end needs: tokenizer, spec, limits, sampling defaults), OUTPUTS (one step's [(request id, error)] of
its requests the engine refused, its requests' sampled tokens and finishes as
core/engine/core_outputs.py's lists, the step's IterationStats and, at most every 50 ms and whenever
the engine goes idle, its health dict), FAILED (start-up failed: reason).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

ADD, ABORT, FINISH, SHUTDOWN = "add", "abort", "finish", "shutdown"
READY, OUTPUTS, FAILED = "ready", "outputs", "failed"

_PICKLE_EXT = 1


@dataclass(frozen=True)
class ClientSockets:
    """Where front end `index` and the engine talk: the front end binds both addresses, the engine connects."""

    index: int
    input_address: str  # front end PUSH -> engine PULL
    output_address: str  # engine PUSH -> front end PULL


def client_sockets(directory: str | Path, count: int) -> list[ClientSockets]:
    """The sockets of `count` front ends, as files in `directory` (private to this server)."""
    return [ClientSockets(index, f"ipc://{Path(directory) / f'input-{index}'}",
                          f"ipc://{Path(directory) / f'output-{index}'}") for index in range(count)]


def _enc_hook(obj: Any) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(_PICKLE_EXT, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _PICKLE_EXT:
        raise msgspec.DecodeError(f"unknown extension type {code} in an engine message")
    return pickle.loads(data)


class MessageCodec:
    """encode([kind, payload]) -> bytes; decode(bytes) -> [kind, payload]. Not thread-safe (one per thread)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._decoder = msgspec.msgpack.Decoder(ext_hook=_ext_hook)

    def encode(self, kind: str, payload: Any = None) -> bytes:
        plain = payload is None or isinstance(payload, str)
        return self._encoder.encode((kind, payload if plain else _enc_hook(payload)))

    def decode(self, frame: bytes) -> tuple[str, Any]:
        kind, payload = self._decoder.decode(frame)
        return kind, payload
