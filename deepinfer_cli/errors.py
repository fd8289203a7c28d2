"""How every command fails: one clear line on stderr and a non-zero exit; a traceback only with --debug."""

from __future__ import annotations

import sys

DEBUG = {"enabled": False}


def fail(message: str, code: int = 1) -> None:
    """Print `error: message` and exit with `code`."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


def not_landed(command: str, issue: int) -> None:
    """A command whose work has not landed yet says so and exits non-zero; none pretends to work."""
    fail(f"`deepinfer {command}` is not implemented yet (tracked in issue #{issue})", code=2)
