"""`deepinfer chat`: an interactive REPL, or one-shot with --prompt."""

from __future__ import annotations

from deepinfer_cli.errors import not_landed


def chat() -> None:
    """Chat with a model (default: SmolLM2-135M-Instruct)."""
    not_landed("chat", 2)
