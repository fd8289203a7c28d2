"""deepinfer's engine core.

    from core import LLM, SamplingParams

`SamplingParams`, `EngineConfig` and the outputs are light; `LLM` and `AsyncEngine` (which pull
in torch) are imported on first use.
"""

from __future__ import annotations

from typing import Any

from core.config import EngineConfig
from core.engine.outputs import CompletionOutput, RequestOutput
from core.engine.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncEngine", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from core.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from core.engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module 'core' has no attribute {name!r}")
