"""End-to-end check: a tiny random Llama's logits on the native path against the reference path.

The model is built in memory from a transformers LlamaConfig (SmolLM2-like: hidden 576, 9 query /
3 KV heads of 64, so K = 576 is not a multiple of 128), loaded into deepinfer's DecoderModel,
and its linears replaced by round-to-nearest W4A16/W3A16 QuantLinears. Three engine-like steps run
on a paged KV cache: two prefills; two decodes plus a new prefill (a mixed batch); three decodes.
The reference pass forces every op onto torch (DEEPINFER_FORCE_REFERENCE=1, TorchPagedAttention);
the native pass uses the kernels (quantized matmuls, decode attention, KV-cache writes).
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from deepinfer.core.attention.native_backend import NativePagedAttention
from deepinfer.core.attention.torch_backend import TorchPagedAttention
from deepinfer.core.engine.worker.step_inputs import SequenceChunk, build_attention_metadata
from deepinfer.core.kv.cache import KVCache
from deepinfer.core.models.decoder import DecoderModel
from deepinfer.core.models.spec import ModelSpec
from deepinfer.core.ops.dispatch import FORCE_REFERENCE_ENV
from deepinfer.core.quant.quantize_model import quantize_projections
from deepinfer.validate.compare import CheckResult, compare

BLOCK_SIZE = 16
VOCAB = 1024


def build_tiny_llama(dtype: torch.dtype, device, bits: int, group_size: int, seed: int = 0,
                     **config_overrides) -> DecoderModel:
    """A 2-layer Llama with random weights, its projections quantized (RTN); config_overrides replace fields of
    the default SmolLM-like shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {"vocab_size": VOCAB, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 2,
              "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    config = LlamaConfig(**(fields | config_overrides))
    torch.manual_seed(seed)
    hf_model = LlamaForCausalLM(config)
    model = DecoderModel(ModelSpec.from_hf_config(config.to_dict()), dtype=dtype, device=device, max_positions=512)
    model.load_weights(hf_model.state_dict().items())
    model.requires_grad_(False)
    quantize_projections(model, bits, group_size=group_size)
    return model.eval()


@contextmanager
def forced_reference(enabled: bool):
    previous = os.environ.get(FORCE_REFERENCE_ENV)
    if enabled:
        os.environ[FORCE_REFERENCE_ENV] = "1"
    else:
        os.environ.pop(FORCE_REFERENCE_ENV, None)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(FORCE_REFERENCE_ENV, None)
        else:
            os.environ[FORCE_REFERENCE_ENV] = previous


# Per step: (request, first new position, new tokens); decodes first, as the runner orders them.
STEPS = (
    (("a", 0, 37), ("b", 0, 20)),
    (("a", 37, 1), ("b", 20, 1), ("c", 0, 9)),
    (("a", 38, 1), ("b", 21, 1), ("c", 9, 1)),
)


@torch.no_grad()
def run_steps(model: DecoderModel, device, kv_quantization: str | None, tokens: dict[str, torch.Tensor]) -> torch.Tensor:
    spec = model.spec
    cache = KVCache(spec.num_layers, 24, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, model.model.norm.weight.dtype,
                    device, quantized=kv_quantization)
    tables = {"a": [3, 7, 1, 12], "b": [5, 0], "c": [9]}
    logits = []
    for step in STEPS:
        chunks = [SequenceChunk(tables[name], start, count) for name, start, count in step]
        metadata, positions = build_attention_metadata(chunks, BLOCK_SIZE, device)
        input_ids = torch.cat([tokens[name][start:start + count] for name, start, count in step])
        hidden = model(input_ids, positions, metadata, cache)  # [T, hidden]
        last_rows = metadata.query_start_loc[1:].long() - 1
        logits.append(model.compute_logits(hidden[last_rows]))  # [B, vocab]
    return torch.cat(logits)


def check_tiny_model(device, dtype: torch.dtype, bits: int, group_size: int, kv_quantization: str | None,
                     rel_tol: float) -> CheckResult:
    case = (f"tiny Llama {str(dtype).removeprefix('torch.')} W{bits}A16 G{group_size} "
            f"{kv_quantization or 'same-dtype'} KV: native vs reference logits")
    model = build_tiny_llama(dtype, device, bits, group_size)
    generator = torch.Generator().manual_seed(1)
    tokens = {name: torch.randint(0, VOCAB, (48,), generator=generator).to(device) for name in "abc"}
    with forced_reference(True):
        model.attention_backend = TorchPagedAttention()
        reference = run_steps(model, device, kv_quantization, tokens)
    with forced_reference(False):
        model.attention_backend = NativePagedAttention()
        native = run_steps(model, device, kv_quantization, tokens)
    result = compare("end_to_end", case, native, reference, rel_tol)
    agree = float((native.argmax(-1) == reference.argmax(-1)).float().mean())
    result.detail = f"argmax agreement {agree:.3f} over {native.shape[0]} next-token positions"
    return result
