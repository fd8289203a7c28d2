"""`deepinfer serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

from deepinfer_cli.errors import not_landed


def serve() -> None:
    """Serve a model over an OpenAI-compatible HTTP API with /health and /metrics."""
    not_landed("serve", 4)
