"""Engine start-up around a ready model: device and dtype, attention backend, warm-up measurement,
KV budget and pool, padded-step runner and CUDA graph capture, in that order.

1. `resolve_device` / `resolve_dtype` (before the model is loaded, for the loader).
2. The attention backend (core/engine/worker/backends.py) goes into `model.attention_backend`; the decode
   mode follows from it (CUDA graphs on a GPU with the native backend unless `enforce_eager`).
3. On a GPU without an explicit pool size, a warm-up runs the largest step the engine will run
   (`warmup_requests`) on scratch KV blocks and measures the peak torch memory; with graphs, their
   memory is measured too (`estimate_graph_memory`). core/engine/worker/memory.py turns that into the KV
   budget, and max_model_len is lowered to what the pool holds.
4. The KV pool (one block more for the padding rows of padded steps); an FP8 pool's per-head scales are
   calibrated from one prefill of a fixed text (core/engine/worker/fp8_calibration.py); the padded-step
   runner, the eager ModelRunner, then the graphs are captured: they bind the pool's addresses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.engine.sched.request import Request
from deepinfer.core.engine.sched.scheduler_output import ScheduledChunk, SchedulerOutput
from deepinfer.core.engine.worker.backends import choose_attention_backend, prefill_tile_tokens
from deepinfer.core.engine.worker.cuda_graphs import PaddedStepRunner
from deepinfer.core.engine.worker.fp8_calibration import calibrate_fp8_scales
from deepinfer.core.engine.worker.memory import DeviceMemory, KVBudget, MiB, log_kv_budget, plan_kv_budget
from deepinfer.core.engine.worker.model_runner import ModelRunner
from deepinfer.core.errors import DeepInferError
from deepinfer.core.kv.cache import QUANTIZATIONS, STORAGE_DTYPES, KVCache
from deepinfer.core.kv.kv_manager import cdiv

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DECODE_MODES = ("graphs", "padded", "eager")
# The graph pool's estimate is widened by this much for the allocator's segment rounding.
GRAPH_MEMORY_MARGIN = 0.1
GRAPH_MEMORY_SLACK = 32 * MiB


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeepInferError(f"device {name!r} asked for, but torch sees no CUDA GPU")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


@dataclass
class EngineRuntime:
    """What start-up built around the model."""

    decode_mode: str  # "graphs" | "padded" | "eager"
    kv_dtype: torch.dtype  # the model's dtype for "auto", "int8" and "fp8"
    kv_quantized: str | None  # "int8" or "fp8" (core/kv/cache.py QUANTIZATIONS), None for plain storage
    kv_budget: KVBudget
    max_model_len: int  # the model's (or the config's), lowered to what the pool holds
    kv_cache: KVCache
    step_runner: PaddedStepRunner | None  # None in eager mode
    runner: ModelRunner


def start_up(config: EngineConfig, model, spec, device: torch.device, dtype: torch.dtype,
             decode_mode: str | None = None, *, tokenizer) -> EngineRuntime:
    """Everything between a ready model and the first step. decode_mode: see LLMEngine; tokenizer: the model's,
    for an FP8 cache's calibration prompt."""
    return _Startup(config, model, spec, device, dtype, tokenizer).run(decode_mode)


class _Startup:
    def __init__(self, config: EngineConfig, model, spec, device: torch.device, dtype: torch.dtype,
                 tokenizer) -> None:
        self.config, self.model, self.spec, self.device, self.dtype = config, model, spec, device, dtype
        self.tokenizer = tokenizer
        self.kv_quantized = config.kv_cache_dtype if config.kv_cache_dtype in QUANTIZATIONS else None
        self.kv_dtype = DTYPES.get(config.kv_cache_dtype, dtype)  # "auto", "int8" and "fp8": the model's dtype
        self.kv_storage_dtype = STORAGE_DTYPES.get(self.kv_quantized, self.kv_dtype)
        self.decode_mode = "eager"

    def run(self, decode_mode: str | None) -> EngineRuntime:
        config, spec = self.config, self.spec
        self.model.attention_backend = choose_attention_backend(
            config.attention_backend, self.device, self.dtype, spec, self.kv_storage_dtype, config.block_size)
        self.decode_mode = self._choose_decode_mode(decode_mode)
        max_model_len = config.max_model_len or spec.max_position_embeddings
        block_bytes = KVCache.bytes_per_block(spec.num_layers, config.block_size, spec.num_kv_heads,
                                              spec.head_dim, self.kv_dtype, self.kv_quantized)
        memory = None
        if self.device.type == "cuda" and config.num_gpu_blocks is None and config.kv_cache_memory is None:
            memory = self._measure_warmup(max_model_len, block_bytes)
        kv_budget = plan_kv_budget(config, block_bytes, memory)
        log_kv_budget(kv_budget, config.block_size)
        max_model_len = self._fit_max_model_len(max_model_len, kv_budget.num_blocks * config.block_size)

        # Padded steps get one block beyond the scheduler's pool, for their padding rows.
        padded = self.decode_mode != "eager"
        kv_cache = self._make_kv_cache(kv_budget.num_blocks + int(padded))
        if self.kv_quantized == "fp8":  # before any graph reads the scales
            calibrate_fp8_scales(self.model, self.tokenizer, kv_cache,
                                 min(max_model_len, config.max_num_batched_tokens))
        step_runner = None
        if padded:
            step_runner = self._make_step_runner(kv_cache, max_model_len, dummy_block=kv_budget.num_blocks)
        runner = ModelRunner(self.model, kv_cache, self.device, block_size=config.block_size,
                             max_num_batched_tokens=config.max_num_batched_tokens,
                             max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
                             step_runner=step_runner)
        if self.decode_mode == "graphs":
            report = step_runner.capture()
            estimate = kv_budget.cuda_graph_bytes
            if estimate is not None and report.memory_bytes > estimate:
                logger.warning("CUDA graphs hold %.0f MiB, more than the %.0f MiB set aside for them",
                               report.memory_bytes / MiB, estimate / MiB)
        return EngineRuntime(self.decode_mode, self.kv_dtype, self.kv_quantized, kv_budget, max_model_len,
                             kv_cache, step_runner, runner)

    def _make_kv_cache(self, num_blocks: int) -> KVCache:
        return KVCache(self.spec.num_layers, num_blocks, self.config.block_size, self.spec.num_kv_heads,
                       self.spec.head_dim, self.kv_dtype, self.device, quantized=self.kv_quantized)

    def _choose_decode_mode(self, requested: str | None) -> str:
        if requested is None:
            graphs_serve = (self.device.type == "cuda" and self.model.attention_backend.name == "native"
                            and not self.config.enforce_eager)
            return "graphs" if graphs_serve else "eager"
        if requested not in DECODE_MODES:
            raise DeepInferError(f"unknown decode_mode {requested!r}; use one of {', '.join(DECODE_MODES)}")
        if requested == "graphs" and self.device.type != "cuda":
            raise DeepInferError("decode_mode 'graphs' needs a CUDA device")
        return requested

    def _make_step_runner(self, kv_cache: KVCache, max_model_len: int, dummy_block: int) -> PaddedStepRunner:
        config, spec = self.config, self.spec
        return PaddedStepRunner(self.model, kv_cache, self.device, block_size=config.block_size,
                                max_num_seqs=config.max_num_seqs,
                                max_num_batched_tokens=config.max_num_batched_tokens,
                                max_model_len=max_model_len, dummy_block=dummy_block,
                                vocab_size=spec.vocab_size, num_kv_heads=spec.num_kv_heads,
                                use_graphs=self.decode_mode == "graphs",
                                prefill_tile_tokens=prefill_tile_tokens(
                                    self.model.attention_backend, self.device, self.dtype, spec.num_heads,
                                    spec.num_kv_heads, spec.head_dim, self.kv_storage_dtype, config.block_size))

    def _measure_warmup(self, max_model_len: int, block_bytes: int) -> DeviceMemory:
        """Peak torch memory of the largest step (weights included), with scratch KV blocks of its own."""
        config = self.config
        num_tokens = min(config.max_num_batched_tokens, max_model_len)
        step, num_blocks = warmup_requests(num_tokens, config.max_num_seqs, config.block_size, max_model_len)
        scratch = self._make_kv_cache(num_blocks)
        runner = ModelRunner(self.model, scratch, self.device, block_size=config.block_size,
                             max_num_batched_tokens=num_tokens, max_num_seqs=config.max_num_seqs,
                             max_model_len=max_model_len)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        runner.execute(step)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - num_blocks * block_bytes
        del runner, scratch
        graph_bytes = self._estimate_graph_memory(max_model_len, block_bytes) if self.decode_mode == "graphs" else 0
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return DeviceMemory(total=total, free=free, torch_reserved=torch.cuda.memory_reserved(self.device),
                            torch_allocated=torch.cuda.memory_allocated(self.device), peak_allocated=peak,
                            cuda_graph_bytes=graph_bytes)

    def _estimate_graph_memory(self, max_model_len: int, block_bytes: int) -> int:
        """What the step graphs will hold: their static buffers, the shared pool and the graphs
        themselves (measured by capturing the largest one alone), the dummy block, widened by a
        margin for the allocator's segment rounding."""
        scratch = self._make_kv_cache(1)  # the padding rows' dummy block only
        before = torch.cuda.memory_allocated(self.device)
        runner = self._make_step_runner(scratch, max_model_len, dummy_block=0)
        static = torch.cuda.memory_allocated(self.device) - before
        captured = runner.measure_capture_memory()
        del runner, scratch
        return int((1 + GRAPH_MEMORY_MARGIN) * (static + captured)) + block_bytes + GRAPH_MEMORY_SLACK

    def _fit_max_model_len(self, max_model_len: int, pool_tokens: int) -> int:
        """One request must always fit the pool alone, or it could never finish."""
        if max_model_len <= pool_tokens:
            return max_model_len
        if self.config.max_model_len is not None:
            raise DeepInferError(
                f"max_model_len {max_model_len} does not fit the KV pool, which holds {pool_tokens} tokens; "
                f"lower max_model_len or give the KV cache more memory")
        logger.warning("max_model_len lowered from the model's %d to %d tokens, what the KV pool holds",
                       max_model_len, pool_tokens)
        return pool_tokens


def warmup_requests(num_tokens: int, max_num_seqs: int, block_size: int,
                    max_model_len: int) -> tuple[SchedulerOutput, int]:
    """The largest step the engine will run: `num_tokens` tokens from max_num_seqs requests, a prefill
    chunk that ends a `max_model_len`-long context (attention's costliest case) plus single-token
    requests, all sampling with top-k/top-p (the sampler's costliest path).
    -> (step, blocks its scratch cache needs).

    The long context costs no memory of its own: its block table cycles over the few blocks the
    chunk writes, so the scratch cache holds only about `num_tokens` tokens.
    """
    num_requests = max(1, min(max_num_seqs, num_tokens))
    prefill_len = num_tokens - (num_requests - 1)
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=1)
    context_len = max(prefill_len, max_model_len)
    num_prefill_blocks = cdiv(prefill_len, block_size) + 1  # the chunk may straddle one more block
    prefill_table = [i % num_prefill_blocks for i in range(cdiv(context_len, block_size))]
    prefill = Request("warmup-0", [0] * context_len, params)
    out = SchedulerOutput(num_batched_tokens=num_tokens)
    start = context_len - prefill_len
    out.chunks.append(ScheduledChunk(prefill, start, prefill_len, prefill_table, sample=True))
    for i in range(1, num_requests):
        decode = Request(f"warmup-{i}", [0], params)
        out.chunks.append(ScheduledChunk(decode, 0, 1, [num_prefill_blocks + i - 1], sample=True))
    return out, num_prefill_blocks + num_requests - 1
