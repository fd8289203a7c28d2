"""A real deepinfer HTTP server for tests: uvicorn in a background thread on a free loopback port.

Each test module starts one server (module-scoped fixture) around a real AsyncEngine and talks to
it over TCP with the `openai` client or httpx, exactly as a user would. uvicorn runs with the
settings `deepinfer serve` uses (core/server/run.py), minus the signal handling.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import threading
import time

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.core.config import EngineConfig
from deepinfer.core.server.app import create_app
from deepinfer.core.server.config import ServerConfig
from deepinfer.core.server.run import uvicorn_config


def with_chat_template(model_dir, directory, template: str):
    """A copy of the model at `model_dir` in `directory` whose chat template is `template`."""
    shutil.copytree(model_dir, directory)
    (directory / "chat_template.jinja").write_text(template)
    return directory


def tools_template_server(model_dir, directory, template: str, name: str) -> ServerThread:
    """A started in-process server of the model at `model_dir` with chat template `template` (one that
    renders tools), served as `name`: what the Anthropic and Responses API tests drive."""
    model = with_chat_template(model_dir, directory, template)
    config = EngineConfig(model=str(model), device="cpu", dtype="float32", max_model_len=512, max_num_seqs=4)
    return ServerThread(config, ServerConfig(served_model_name=name, shutdown_timeout_s=1.0)).start()


def free_port() -> int:
    """A loopback port nothing listens on now (for a `deepinfer serve` subprocess)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_healthy(process: subprocess.Popen, base_url: str, timeout_s: float = 120.0) -> None:
    """Poll /health until the server in `process` answers 200; fail with its output if it exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        try:
            if httpx.get(base_url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{base_url} did not become healthy in {timeout_s:.0f} s")


class ServerThread:
    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig | None = None, **app_kwargs):
        server_config = server_config or ServerConfig(shutdown_timeout_s=1.0)
        self.app = create_app(engine_config, server_config, **app_kwargs)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))  # the OS picks a free port; no race with other tests
        self.port = self._socket.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        # The settings `deepinfer serve` runs with (guarded protocol, timeouts), signals left to pytest.
        config = uvicorn_config(self.app, server_config, server_config.max_connections, log_level="warning")
        self.server = uvicorn.Server(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.server.serve(sockets=[self._socket])

    @property
    def state(self):
        return self.app.state.deepinfer

    @property
    def engine(self):
        return self.state.engine

    def start(self, wait_ready: bool = True, timeout_s: float = 180.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        if wait_ready:
            while self.state.status == "loading":
                if time.monotonic() > deadline:
                    raise RuntimeError("the model did not load in time")
                time.sleep(0.05)
            if self.state.status != "ready":
                raise RuntimeError(f"the model failed to load: {self.state.error}")
        return self

    def stop(self) -> None:
        """As a signal would: running requests are ended at once, then uvicorn shuts down."""
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self.state.begin_shutdown, 0.0)
        self.server.should_exit = True
        self._thread.join(timeout=30)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """/metrics parsed: {(sample name, sorted labels without model_name): value}."""
        text = httpx.get(self.base_url + "/metrics").text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
                values[(sample.name, labels)] = sample.value
        return values

    def wait_idle(self, timeout_s: float = 30.0) -> dict:
        """Poll until no request is running or waiting; returns the engine's last health()."""
        deadline = time.monotonic() + timeout_s
        while True:
            health = self.engine.health()
            scheduler = health["scheduler"]
            if scheduler["num_running"] == 0 and scheduler["num_waiting"] == 0:
                return health
            if time.monotonic() > deadline:
                raise AssertionError(f"engine still busy after {timeout_s}s: {scheduler}")
            time.sleep(0.02)

