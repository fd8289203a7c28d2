"""run_server: what `deepinfer serve` does, in order.

1. Bind the port. A busy port (or an address this host does not have) fails here, in one line,
   before anything slow happens.
2. Fit the open-file limit to --max-connections (raised toward the hard limit when it can be,
   else the cap is lowered), so the connection cap, not the descriptor table, is what runs out.
3. Serve: uvicorn over the bound socket with the guarded HTTP protocol (connection.py); the model
   loads in the background meanwhile (/health says "loading").
4. On SIGTERM or SIGINT: answer new requests (and /health) with a 503, let running requests
   finish for up to --shutdown-timeout seconds, then end the rest (a stream gets its final chunk
   with finish_reason "abort" and `data: [DONE]`). Once none is running, stop accepting, stop the
   engine and return. A second signal ends the running requests and stops at once.
Returns the exit status: 0 after SIGTERM (a requested, clean stop), 130 after SIGINT (the shell's
convention for Ctrl-C), 1 when the engine process (--engine-process) died; a model that cannot load
is a ServerStartError with its reason.

With --api-server-count N > 1, step 1 binds the port without listening (SO_REUSEPORT), and steps 2-4
are core/server/api_servers.py's: N processes, each listening on that port and running
`serve_socket`, in front of one engine-core process, and this process supervises them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import resource
import signal
import socket
import threading

import uvicorn

from deepinfer.core.config import EngineConfig
from deepinfer.core.errors import DeepInferError
from deepinfer.core.server.app import create_app
from deepinfer.core.server.config import ServerConfig
from deepinfer.core.server.connection import guarded_protocol

logger = logging.getLogger("deepinfer.server")

FD_RESERVE = 256  # descriptors beyond the connections: model files, the engine, logs, CUDA
BACKLOG = 2048
# uvicorn's own backstop after our --shutdown-timeout: ended streams need an engine step to finish.
SHUTDOWN_GRACE_S = 10.0
ENGINE_DIED_EXIT_CODE = 1


class ServerStartError(DeepInferError):
    """The server cannot start: the port is busy, the address is not this host's, the model does not load."""


def bind_socket(host: str, port: int, shared_port: bool = False, listen: bool = True) -> socket.socket:
    """A listening TCP socket on host:port; ServerStartError in one line when that is not possible.
    `shared_port`: SO_REUSEPORT, so that more sockets of this user with it may listen on the port (the
    kernel spreads the connections over the listening ones); `listen` False only holds the port."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as err:
        raise ServerStartError(f"cannot listen on {where}: {err.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if shared_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        if listen:
            sock.listen(BACKLOG)
    except OSError as err:
        sock.close()
        hint = " (another process is listening there; pick another --port)" if err.errno == errno.EADDRINUSE else ""
        raise ServerStartError(f"cannot listen on {where}: {err.strerror}{hint}") from None
    sock.set_inheritable(True)
    return sock


def fit_open_files(max_connections: int) -> int:
    """The connection cap the open-file limit allows, after raising the soft limit toward the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft != resource.RLIM_INFINITY and soft < needed:
        fitted = max(1, soft - FD_RESERVE)
        logger.warning("the open-file limit is %d: serving at most %d connections instead of %d "
                       "(raise it with ulimit -n)", soft, fitted, max_connections)
        return fitted
    return max_connections


def uvicorn_config(app, server_config: ServerConfig, max_connections: int, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's settings for `app`: the guarded HTTP protocol, no websockets, our timeouts."""
    protocol = guarded_protocol(server_config.request_timeout_s, max_connections,
                                on_refused=app.state.deepinfer.metrics.count_rejection,
                                stream_write_timeout_s=server_config.stream_write_timeout_s)
    return uvicorn.Config(app, http=protocol, ws="none", lifespan="on", log_level=log_level.lower(),
                          timeout_keep_alive=server_config.keep_alive_timeout_s, backlog=BACKLOG,
                          timeout_graceful_shutdown=server_config.shutdown_timeout_s + SHUTDOWN_GRACE_S)


class _Server(uvicorn.Server):
    """uvicorn's server with our signal handling instead of its own (which re-raises the signal at exit)."""

    def __init__(self, config: uvicorn.Config, on_signal, signals: tuple[int, ...]):
        super().__init__(config)
        self._on_signal = on_signal
        self._signals = signals
        self.received: list[int] = []

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in self._signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _handle(self, sig: int, _frame) -> None:
        self.received.append(sig)
        if len(self.received) > 1:
            self.should_exit = True  # uvicorn: stop accepting, close idle connections, wait for busy ones
        self._on_signal(len(self.received))


def run_server(engine_config: EngineConfig, server_config: ServerConfig, log_level: str = "info") -> int:
    several = server_config.api_server_count > 1  # each API server listens; this process holds the port
    sock = bind_socket(server_config.host, server_config.port, shared_port=several, listen=not several)
    host, port = sock.getsockname()[:2]
    logger.info("listening on http://%s:%d (the model loads in the background)",
                f"[{host}]" if ":" in host else host, port)
    if several:
        from deepinfer.core.server.api_servers import run_api_servers

        try:
            return run_api_servers(port, engine_config, server_config, log_level)
        finally:
            sock.close()
    return serve_socket(sock, engine_config, server_config, log_level)


def serve_socket(sock: socket.socket, engine_config: EngineConfig, server_config: ServerConfig,
                 log_level: str = "info", signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM),
                 **app_kwargs) -> int:
    """Serve on the listening `sock` until a signal of `signals` (or the engine's death) stops it; closes
    `sock`. `app_kwargs` go to create_app (an engine factory, shared metric tallies). -> the exit status."""
    max_connections = fit_open_files(server_config.max_connections)
    load_errors: list[Exception] = []

    def stop_on_load_failure(err: Exception) -> None:
        load_errors.append(err)
        server.should_exit = True

    engine_died: list[bool] = []

    def stop_on_engine_death() -> None:  # on the engine client's thread
        engine_died.append(True)
        server.should_exit = True

    app = create_app(engine_config, server_config, on_load_failed=stop_on_load_failure,
                     on_engine_dead=stop_on_engine_death, **app_kwargs)
    state = app.state.deepinfer
    running: list[asyncio.AbstractEventLoop] = []

    def stop_serving() -> None:
        server.should_exit = True

    def on_signal(count: int) -> None:  # inside the signal handler: hand the work to the event loop
        if not running:
            stop_serving()
            return
        if count == 1:  # the listener stays open, answering 503, until the running requests are done
            running[0].call_soon_threadsafe(state.begin_shutdown, server_config.shutdown_timeout_s, stop_serving)
        else:
            running[0].call_soon_threadsafe(state.end_requests)

    server = _Server(uvicorn_config(app, server_config, max_connections, log_level), on_signal, signals)

    async def serve() -> None:
        running.append(asyncio.get_running_loop())
        await server.serve(sockets=[sock])

    try:
        asyncio.run(serve())
    finally:
        sock.close()
    if load_errors:
        raise ServerStartError(str(load_errors[0]) or type(load_errors[0]).__name__)
    if engine_died:
        logger.error("the engine process died; the server stopped")
        return ENGINE_DIED_EXIT_CODE
    if server.received and server.received[0] == signal.SIGINT:
        return 130
    return 0
