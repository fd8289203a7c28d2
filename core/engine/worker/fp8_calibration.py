"""The FP8 KV cache's per-layer, per-KV-head scales, calibrated from the model's own K and V at engine start.

A fixed scale (FP8_DEFAULT_SCALE, 1.0) leaves e4m3's range to chance: heads whose values stay far below 1 fall into
its subnormals (below 2^-6 the codes are multiples of 2^-9), heads beyond 448 saturate. Before the CUDA graphs are
captured, `calibrate_fp8_scales` runs one prefill of CALIBRATION_TEXT (as a chat prompt where the tokenizer has a
template, so the template's tokens are seen too) over an unquantized scratch cache in the model's dtype, reads each
layer's cached K (after RoPE) and V back, and sets

    key_scales[l][h]   = amax(|K| of layer l, KV head h, over tokens and head_dim) * SCALE_MARGIN / 448
    value_scales[l][h] = the same over V

into the FP8 cache's device tensors in place (their addresses stay what the graphs will read).
SCALE_MARGIN leaves headroom for values beyond the calibration text's (other texts can exceed its amax):
e4m3's precision is relative, so a larger scale costs only the subnormal range at the bottom, which moves up by
the same factor, while a value past 448 * scale saturates. A head whose values are all zero keeps
FP8_DEFAULT_SCALE.
"""

from __future__ import annotations

import torch

from deepinfer.core.engine.worker.step_inputs import SequenceChunk, build_attention_metadata
from deepinfer.core.kv.cache import FP8_DEFAULT_SCALE, FP8_MAX, KVCache
from deepinfer.core.kv.kv_manager import cdiv

SCALE_MARGIN = 2.0
CALIBRATION_TEXT = (
    "The history of the lighthouse begins with fires lit on hills to guide ships home. Later towers of stone held "
    "oil lamps behind lenses, and a keeper trimmed the wicks every night. Today most lights run on their own.\n\n"
    "To bake bread, mix 500 g of flour, 350 ml of warm water, 10 g of salt and 7 g of yeast. Knead for ten "
    "minutes, let the dough rise for an hour, shape it, and bake at 230 degrees for about 35 minutes.\n\n"
    "def mean(values):\n    return sum(values) / len(values)\n\n"
    "A CPU cache keeps recently used memory close to the core: an L1 hit takes about four cycles, a miss that "
    "goes to main memory can take hundreds. Mercury, Venus, Earth and Mars are the rocky planets; Jupiter, Saturn, "
    "Uranus and Neptune are the giants. Dear Anna, the mountains were beautiful, we walked for hours every day "
    "and slept in a small hut above the lake. Questions? Answers! 1, 2, 3 ... 42."
)


def calibration_prompt(tokenizer) -> list[int]:
    """CALIBRATION_TEXT as the tokens a served request would start with."""
    if getattr(tokenizer, "has_chat_template", False):
        return tokenizer.encode_chat([{"role": "user", "content": CALIBRATION_TEXT}])
    return tokenizer.encode(CALIBRATION_TEXT)


def head_scales(pool: torch.Tensor) -> torch.Tensor:
    """An unquantized layer pool [NB, KVH, BS, D] -> its per-KV-head FP8 scales [KVH] float32."""
    amax = pool.float().abs().amax(dim=(0, 2, 3))  # [KVH]
    scales = amax * SCALE_MARGIN / FP8_MAX
    return torch.where(amax > 0, scales, torch.full_like(scales, FP8_DEFAULT_SCALE))


@torch.inference_mode()
def calibrate_fp8_scales(model, tokenizer, kv_cache: KVCache, max_tokens: int) -> None:
    """Set the FP8 cache `kv_cache`'s key_scales / value_scales from one prefill of the calibration prompt's first
    `max_tokens` tokens (what one step and the model's positions take)."""
    ids = calibration_prompt(tokenizer)[:max_tokens]
    device = kv_cache.key_caches[0].device
    blocks = cdiv(len(ids), kv_cache.block_size)
    scratch = KVCache(kv_cache.num_layers, blocks, kv_cache.block_size, kv_cache.num_kv_heads, kv_cache.head_dim,
                      kv_cache.dtype, device)
    meta, positions = build_attention_metadata([SequenceChunk(list(range(blocks)), 0, len(ids))],
                                               kv_cache.block_size, device)
    model(torch.tensor(ids, device=device), positions, meta, scratch)
    for layer in range(kv_cache.num_layers):
        kv_cache.key_scales[layer].copy_(head_scales(scratch.key_caches[layer]))
        kv_cache.value_scales[layer].copy_(head_scales(scratch.value_caches[layer]))
