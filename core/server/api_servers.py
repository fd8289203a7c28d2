"""run_api_servers: `deepinfer serve --api-server-count N`, N API-server processes in front of one
engine-core process.

One API server does all of the front end's work on one GIL: reading and parsing each request, its
chat template and tokenization, and beside every open stream its detokenization, stop strings and
SSE chunks. At high concurrency that process, not the engine, bounds the throughput, and time to
first token grows with the requests it parses one after another. Here each of N API servers is the
whole front end (core/server/app.py over run.py's `serve_socket`) for the connections it accepts;
the engine-core process (core/engine/sched/core_process.py) serves them all.

- Each API server listens on the port with a socket of its own (SO_REUSEPORT), from when its engine
  client is attached (the model loaded): until then the port refuses connections, and once any API
  server answers, every listening one is ready. The kernel spreads
  new connections evenly over them by a hash of each client's address and port. (One socket
  shared by all would leave that to a race: the process that wakes first accepts every connection
  queued, and bursts of connections pile onto one API server.) This process bound the port first,
  without listening, so a busy port still fails at once and the port stays held while API servers
  start and stop.
- The engine core is spawned with one ClientSockets per API server; each API server's
  EngineCoreClient binds its own and attaches to it (core/engine/frontend/core_client.py).
- /metrics: the tallies are shared memory (metric_tallies.py) that every API server adds into, so
  any API server's /metrics is the total. /health is each API server's view of the engine: healthy
  only while the engine process is alive.
- Signals: the children ignore SIGINT and SIGTERM, which often reach the whole process group (Ctrl-C,
  `timeout`, systemd's stop), so that only this process acts on them, once each. It turns each one
  it gets into STOP_SIGNAL to every API server, which drains on the first and ends its running
  requests on the second, as a single server does on SIGTERM; an API server that is done tells the
  engine, and the engine stops after the last one.
- Supervision: when a child ends unasked, the rest are stopped. If the engine died, each API server
  has ended its open requests with a 503 and exits 1 by itself; if an API server died, the others
  get STOP_SIGNAL. Whatever does not stop in time is killed, so the command never hangs and leaves no
  process behind. An API server also gets STOP_SIGNAL when this process dies (PR_SET_PDEATHSIG on
  Linux), and the engine core stops when its parent is gone (core_process.py).

Exit status: that of a single server (0 after SIGTERM, 130 after SIGINT, 1 when the engine died),
or 1 when an API server failed or the model did not load (API server 0 prints the reason).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import time

from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.core_ipc import ClientSockets, client_sockets
from deepinfer.core.engine.frontend.core_client import SHUTDOWN_TIMEOUT_S, EngineCoreClient
from deepinfer.core.engine.sched.core_process import run_engine_core
from deepinfer.core.server.config import ServerConfig
from deepinfer.core.server.metric_tallies import MetricTallies
from deepinfer.core.server.metrics import new_tallies
from deepinfer.core.server.run import (
    ENGINE_DIED_EXIT_CODE,
    SHUTDOWN_GRACE_S,
    ServerStartError,
    bind_socket,
    serve_socket,
)

logger = logging.getLogger("deepinfer.server")

STOP_SIGNAL = signal.SIGUSR1  # the supervisor's "stop" to an API server
POLL_S = 0.1  # how often the supervisor looks at its children
ENGINE_DEATH_GRACE_S = 10.0  # after the engine died: for the API servers to answer their open requests and exit
FAILED_EXIT_CODE = 1
START_FAILED_EXIT_CODE = 3  # an API server's: its engine never became ready (it printed why)
_PR_SET_PDEATHSIG = 1  # prctl(2)


def run_api_servers(port: int, engine_config: EngineConfig, server_config: ServerConfig,
                    log_level: str = "info") -> int:
    """Serve `port` (bound by this process, SO_REUSEPORT) with server_config.api_server_count API servers
    and one engine core; -> the exit status."""
    import torch

    context = multiprocessing.get_context("spawn")
    tallies = new_tallies(shared=True)
    socket_dir = tempfile.TemporaryDirectory(prefix="deepinfer-engine-")
    clients = client_sockets(socket_dir.name, server_config.api_server_count)
    received: list[int] = []
    api_servers: list[multiprocessing.Process] = []

    def on_signal(sig: int, _frame) -> None:
        received.append(sig)
        for process in api_servers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, STOP_SIGNAL)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    engine = context.Process(target=run_engine_core, args=(engine_config, clients, torch.get_num_threads()),
                             name="deepinfer-engine-core", daemon=True)
    try:
        with _signals_ignored():
            engine.start()
        for client in clients:
            process = context.Process(
                target=_serve_api_server, name=f"deepinfer-api-server-{client.index}", daemon=True,
                args=(client, engine.pid, port, engine_config, server_config, tallies, log_level, os.getpid()))
            with _signals_ignored():
                process.start()
            api_servers.append(process)
            if received:  # a signal came while it started
                os.kill(process.pid, STOP_SIGNAL)
        logger.info("%d API servers in front of engine process %d", len(api_servers), engine.pid)
        return _supervise(engine, api_servers, received, server_config)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for process in [*api_servers, engine]:
            if process.pid is not None and process.exitcode is None:
                process.kill()
                process.join()
        socket_dir.cleanup()


@contextlib.contextmanager
def _signals_ignored():
    """A process started inside inherits SIGINT and SIGTERM ignored (through exec): they are this process's."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(engine: multiprocessing.Process, api_servers: list[multiprocessing.Process], received: list[int],
               server_config: ServerConfig) -> int:
    """Wait until every API server has exited, stopping the rest when one child ends unasked; then wait
    for the engine (it stops after the last API server's SHUTDOWN). -> the exit status."""
    drain_s = server_config.shutdown_timeout_s + SHUTDOWN_GRACE_S + SHUTDOWN_TIMEOUT_S
    cause: str | None = None
    deadline: float | None = None
    while True:
        live = [process for process in api_servers if process.exitcode is None]
        if not live:
            break
        waited = [process.sentinel for process in live] + ([engine.sentinel] if engine.exitcode is None else [])
        multiprocessing.connection.wait(waited, timeout=POLL_S)
        now = time.monotonic()
        if cause is None and not received:
            failed = next((p for p in api_servers if p.exitcode is not None), None)
            if engine.exitcode is not None:
                cause, deadline = "engine", now + ENGINE_DEATH_GRACE_S
            elif failed is not None:
                cause, deadline = failed.name, now + drain_s
                logger.error("%s exited (exit code %s); stopping the others", failed.name, failed.exitcode)
                for process in live:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(process.pid, STOP_SIGNAL)
        if received and deadline is None:
            deadline = now + drain_s
        if deadline is not None and now > deadline:
            for process in live:
                if process.exitcode is None:
                    logger.warning("%s did not stop in time; killing it", process.name)
                    process.kill()
    engine.join(SHUTDOWN_TIMEOUT_S)
    if engine.exitcode is None:
        logger.warning("the engine process did not stop in %.0f s; killing it", SHUTDOWN_TIMEOUT_S)
        engine.kill()
        engine.join()
    if any(p.exitcode == START_FAILED_EXIT_CODE for p in api_servers):
        return FAILED_EXIT_CODE
    if cause == "engine":
        logger.error("the engine process died (exit code %s); the API servers stopped", engine.exitcode)
        return ENGINE_DIED_EXIT_CODE
    if cause is not None:
        return FAILED_EXIT_CODE
    stopped_cleanly = all(p.exitcode in (0, -STOP_SIGNAL) for p in api_servers)  # -STOP_SIGNAL: while starting
    if not stopped_cleanly:
        return FAILED_EXIT_CODE
    return 130 if received and received[0] == signal.SIGINT else 0


def _serve_api_server(client: ClientSockets, engine_pid: int, port: int, engine_config: EngineConfig,
                      server_config: ServerConfig, tallies: MetricTallies, log_level: str, supervisor: int) -> None:
    """An API server process's main: the app listening on `port`, its engine the client `client` of the
    engine core."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    _exit_with(supervisor)
    logging.basicConfig(level=log_level.upper(),
                        format=f"%(levelname)s %(name)s[{client.index}]: %(message)s")

    try:
        # Attached (the model loaded) before it listens: the kernel hands a port's connections only to listening
        # sockets, so no API server of the group answers "still loading" once another has answered ready.
        try:
            engine = EngineCoreClient(engine_config, client, engine_pid)
        except Exception as err:  # noqa: BLE001 -- the model's load error, said in one line
            raise ServerStartError(str(err) or type(err).__name__) from err
        sock = bind_socket(server_config.host, port, shared_port=True)
        code = serve_socket(sock, engine_config, server_config, log_level, signals=(STOP_SIGNAL,),
                            engine_factory=lambda config: engine, metric_tallies=tallies)
    except ServerStartError as err:
        if client.index == 0:  # every API server failed alike; one line says why
            print(f"error: cannot serve: {err}", file=sys.stderr)
        code = START_FAILED_EXIT_CODE
    sys.exit(code)


def _exit_with(supervisor: int) -> None:
    """STOP_SIGNAL from the kernel when the supervisor dies (Linux); and an exit at once if it is gone already."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, STOP_SIGNAL)
    if os.getppid() != supervisor:
        sys.exit(FAILED_EXIT_CODE)
