"""EngineConfig: every knob of the engine in one validated dataclass.

The CLI (`chat`, `serve`, `bench`) and the Python API (`LLM(model, **engine_args)`) build one of
these; nothing below the engine reads command-line flags.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
               "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_size(text: str | int | None) -> int | None:
    """'4GiB' -> 4294967296, '512MB' -> 512000000, 1024 -> 1024, None -> None."""
    if text is None or isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot read size {text!r}; use e.g. 4GiB, 512MiB, 2GB or a byte count")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


@dataclass
class EngineConfig:
    # Path to an HF dir, .gguf file or deepinfer layered dir, or a Hugging Face id ORG/NAME[:QUANT]
    # (core/weights/hub.py); None = the default model.
    model: str | None = None
    revision: str | None = None  # branch, tag or commit of a Hugging Face id; None = main
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: fp32 on CPU, bf16/fp16 on GPU)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 0

    # KV cache
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # auto (= model dtype) | int8 | fp8 | float16 | bfloat16 | float32
    enable_prefix_caching: bool = True
    num_gpu_blocks: int | None = None  # exact block count; overrides every memory budget (tests)
    gpu_memory_utilization: float = 0.90  # fraction of total device memory deepinfer may use
    reserve_memory_mb: int = 0  # kept free for other programs on top of the utilization bound
    kv_cache_memory: int | None = None  # bytes for the KV pool, exactly
    max_vram: int | None = None  # weights + activations + KV stay inside this many bytes
    cpu_kv_cache_memory: int = 512 * 1024**2  # KV pool size when running on the CPU

    # Scheduler
    max_model_len: int | None = None  # None = the model's own context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (prefill chunks + decodes)
    max_waiting_requests: int = 1024  # bounded waiting queue; beyond it add_request raises QueueFullError

    # Execution
    # Ranks the model is split over (one process each, core/distributed): heads, MLP channels and vocabulary.
    tensor_parallel_size: int = 1
    attention_backend: str = "auto"  # auto | torch | native
    enforce_eager: bool = False
    # Overlap the host's per-step work with the device: schedule and launch step N+1 while step N
    # runs, then apply N (outputs come one step later; tokens are identical). False: step by step.
    async_scheduling: bool = True
    dummy_weights: bool = False
    shape: str | None = None  # configs/shapes/<shape>.json for dummy-weight runs
    # An HF directory or .gguf file whose tokenizer replaces the model's (vLLM's --tokenizer): e.g. a real
    # vocabulary for a dummy-weight benchmark, whose own is one id per byte.
    tokenizer: str | None = None
    quantization: str | None = None  # None | "w4a16" | "w3a16": round-to-nearest at load time (group 128)
    # A GPTQ / AWQ / GGUF checkpoint runs directly, converted at load (core/models/direct_load.py); a lossy
    # conversion (a GGUF's Q5_K / Q6_K projections to 8 bits) is kept in the conversion cache unless this is off.
    convert_cache: bool = True

    # Sampling defaults over the model's own (generation_config.json, GGUF metadata), e.g.
    # {"temperature": 0.2}: what a request of LLM, chat or serve that leaves the field unset samples
    # with (chat's and serve's --temperature, --top-p, --top-k, --min-p, --repetition-penalty).
    override_generation_config: dict[str, float | int] | None = None

    def __post_init__(self) -> None:
        self.max_vram = parse_size(self.max_vram)
        self.kv_cache_memory = parse_size(self.kv_cache_memory)
        self.cpu_kv_cache_memory = parse_size(self.cpu_kv_cache_memory)
        checks = [
            (self.dtype in ("auto", "float32", "bfloat16", "float16"), f"unknown dtype {self.dtype!r}"),
            (self.kv_cache_dtype in ("auto", "int8", "fp8", "float16", "bfloat16", "float32"),
             f"unknown kv_cache_dtype {self.kv_cache_dtype!r}"),
            (self.block_size in (8, 16, 32, 64, 128), f"block_size must be 8, 16, 32, 64 or 128, got {self.block_size}"),
            (0.0 < self.gpu_memory_utilization <= 1.0,
             f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"),
            (self.reserve_memory_mb >= 0, "reserve_memory_mb must be >= 0"),
            (self.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1"),
            (self.max_waiting_requests >= 1, "max_waiting_requests must be >= 1"),
            (self.num_gpu_blocks is None or self.num_gpu_blocks >= 1, "num_gpu_blocks must be >= 1"),
            (self.attention_backend in ("auto", "torch", "native"),
             f"unknown attention_backend {self.attention_backend!r}"),
            (self.quantization in (None, "w4a16", "w3a16"), f"unknown quantization {self.quantization!r}"),
            (self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1"),
            (self.tensor_parallel_size == 1 or self.kv_cache_dtype != "fp8",
             "kv_cache_dtype fp8 is not built for tensor_parallel_size > 1 (its scales are calibrated on one rank)"),
            (not self.dummy_weights or self.shape is not None or self.model is not None,
             "dummy_weights needs --shape NAME or a model config"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.override_generation_config is not None:
            if not isinstance(self.override_generation_config, dict):
                raise ValueError("override_generation_config must map sampling fields to values, e.g. "
                                 "{'temperature': 0.2}")
            from deepinfer.core.engine.sampling_params import SamplingDefaults

            SamplingDefaults.layer(flags=self.override_generation_config)  # raises for an unknown field or bad value
