"""`deepinfer convert SRC OUT`: GPTQ / AWQ / GGUF / HF checkpoints to the W4A16/W3A16 layered format."""

from __future__ import annotations

from deepinfer_cli.errors import not_landed


def convert() -> None:
    """Convert a GPTQ, AWQ, GGUF or HF checkpoint to deepinfer's W4A16/W3A16 layered format."""
    not_landed("convert", 5)
