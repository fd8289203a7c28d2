"""How every command fails: one clear line on stderr and a non-zero exit; a traceback only with --debug."""

from __future__ import annotations

import sys

DEBUG = {"enabled": False}


def fail(message: str, code: int = 1) -> None:
    """Print `error: message` and exit with `code`."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)

