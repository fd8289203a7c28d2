"""`bench serve --serve MODEL`: a `deepinfer serve` of its own on a free loopback port, for one run.

The server is a child process in a session of its own (the terminal's Ctrl-C reaches only the
benchmark, which then stops the server itself, after the partial results are kept); on Linux it
also gets SIGTERM from the kernel when the benchmark dies without cleaning up, so no server is
left behind however the benchmark ends. Its output goes to a log file whose tail is shown when it
fails to start. Stopping is what a user's Ctrl-C does (SIGINT: running requests are ended, the
engine stops), then SIGKILL if it takes more than `stop_timeout_s`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from deepinfer.core.errors import DeepInferError

_PR_SET_PDEATHSIG = 1  # prctl(2)
PORT_ATTEMPTS = 3  # another process may take the free port before the server binds it


class ServerLaunchError(DeepInferError):
    """The benchmark's own server did not come up."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _parent_death_signal():
    """A function for the child to run before exec that asks the kernel for SIGTERM when the parent
    dies (Linux), or None. libc is looked up here, in the parent: the child only makes the call."""
    if sys.platform != "linux":
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class LocalServer:
    """`with LocalServer(model, serve_args) as server:` ... `server.base_url` ...; stopped on leaving."""

    def __init__(self, model: str, serve_args: str = "", startup_timeout_s: float = 600.0,
                 stop_timeout_s: float = 30.0) -> None:
        self.model = model
        self.extra_args = shlex.split(serve_args)
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.process: subprocess.Popen | None = None
        self.base_url = ""
        self.command: list[str] = []
        self._log = None

    def __enter__(self):
        try:
            for attempt in range(PORT_ATTEMPTS):
                if self._start(free_port(), last=attempt == PORT_ATTEMPTS - 1):
                    return self
        except BaseException:
            self.stop()
            raise
        raise AssertionError("unreachable: the last attempt raises")

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self, port: int, last: bool) -> bool:
        """True once the server on `port` is healthy; False when it exited (the port taken) and may be retried."""
        self.stop()
        self.base_url = f"http://127.0.0.1:{port}"
        self.command = [sys.executable, "-m", "deepinfer.cli.main", "serve", "--model", self.model,
                        "--host", "127.0.0.1", "--port", str(port), *self.extra_args]
        # kept open for the server's lifetime, closed and removed by stop()
        self._log = tempfile.NamedTemporaryFile(prefix="deepinfer-bench-serve-", suffix=".log",  # noqa: SIM115
                                                delete=False)
        # preexec_fn runs one prctl call between fork and exec (nothing that takes a lock)
        self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=self._log,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=_parent_death_signal())  # noqa: PLW1509
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                tail = self.log_tail()
                if not last and "cannot listen" in tail:
                    return False
                raise ServerLaunchError(f"deepinfer serve exited with status {code} before it was ready:\n{tail}")
            if self._healthy():
                return True
            time.sleep(0.25)
        raise ServerLaunchError(f"deepinfer serve was not ready in {self.startup_timeout_s:g} s:\n{self.log_tail()}")

    @property
    def serve_command(self) -> str:
        """The server's command line as a user would type it."""
        return shlex.join(["deepinfer", *self.command[3:]])  # after `python -m deepinfer.cli.main`

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False  # not listening yet, or 503 while the model loads

    def log_tail(self, lines: int = 20) -> str:
        if self._log is None:
            return ""
        text = Path(self._log.name).read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        """SIGINT, then SIGKILL after `stop_timeout_s`; waits for the process to be gone."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log is not None:
            self._log.close()
            with contextlib.suppress(OSError):
                os.unlink(self._log.name)
            self._log = None
