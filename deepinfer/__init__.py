"""deepinfer: an LLM inference engine core and toolkit for one GPU.

    from deepinfer import LLM, SamplingParams

The installed distribution exposes the repository's folders under this one namespace:
`deepinfer.core` (core/), `deepinfer.kernels` (kernels/), `deepinfer.cli` (deepinfer_cli/) and
`deepinfer.configs` (configs/); setup.py maps them.
`SamplingParams`, `EngineConfig` and the outputs are light; `LLM` and `AsyncEngine` (which pull in
torch) are imported on first use.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.frontend.outputs import CompletionOutput, RequestOutput
from deepinfer.core.engine.sampling_params import SamplingParams

try:
    __version__ = version("deepinfer")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["LLM", "AsyncEngine", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams",
           "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from deepinfer.core.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from deepinfer.core.engine.frontend.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
