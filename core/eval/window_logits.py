"""Every position's logits of one token window, through the model's own forward and a paged KV cache of its own.

The engine computes logits for a request's last token only; an evaluation needs them at every position,
so it drives the DecoderModel directly: the window is one prefill chunk (positions 0 .. T-1) in a fresh
cache, staged as the engine's eager runner stages a step (core/engine/worker/step_inputs.py).
"""

from __future__ import annotations

import torch

from deepinfer.core.engine.worker.step_inputs import SequenceChunk, build_attention_metadata
from deepinfer.core.kv.cache import KVCache
from deepinfer.core.models.decoder import DecoderModel

BLOCK_SIZE = 16


class WindowLogits:
    """Logits [T, vocab] float32 of windows of up to `max_tokens` tokens, on the model's device."""

    def __init__(self, model: DecoderModel, max_tokens: int) -> None:
        embedding = model.model.embed_tokens.weight  # the model's dtype and device
        self.model, self.device = model, embedding.device
        spec = model.spec
        self.num_blocks = -(-max_tokens // BLOCK_SIZE)
        self.cache = KVCache(spec.num_layers, self.num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim,
                             embedding.dtype, self.device)

    @torch.no_grad()
    def __call__(self, token_ids: list[int]) -> torch.Tensor:
        chunk = SequenceChunk(list(range(self.num_blocks)), 0, len(token_ids))
        metadata, positions = build_attention_metadata([chunk], BLOCK_SIZE, self.device)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(self.model(ids, positions, metadata, self.cache))
