"""The reference attention backend's CPU causal path (first chunks of prompts) against explicit per-request math.

A step whose prefill chunks all start at position 0 takes SDPA's own causal mask and GQA; one with a chunk after a
cached context, a sliding window or a softcap keeps the explicit mask. Both must give softmax(q k^T * scale) v over
keys 0..p (HF's causal rule), computed here request by request with repeated K/V heads.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.core.attention.torch_backend import TorchPagedAttention
from deepinfer.core.engine.worker.step_inputs import SequenceChunk, build_attention_metadata
from deepinfer.core.kv.cache import KVCache

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 16, 4


@pytest.mark.parametrize("window", [None, 3])
def test_first_chunks_and_later_chunks_match_explicit_attention(window):
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM ** -0.5
    cache = KVCache(1, 32, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    backend = TorchPagedAttention()
    contexts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # request -> all its keys, values so far
    tables = {0: [5, 2, 9], 1: [7, 1, 3, 11], 2: [4, 8]}
    steps = [[(0, 0, 9), (1, 0, 13)],  # two first chunks: the causal path (without a window)
             [(0, 9, 1), (1, 13, 2), (2, 0, 6)]]  # a decode, a later chunk, a first chunk: the explicit mask
    for step in steps:
        chunks = [SequenceChunk(tables[r], start, n) for r, start, n in step]
        meta, _ = build_attention_metadata(chunks, BLOCK, "cpu")
        tokens = sum(n for _, _, n in step)
        query = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen)
        key = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen)
        value = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen)
        out = backend.forward(0, query, key, value, meta, cache, scale, window, None)
        offset = 0
        for r, start, n in step:
            old_k, old_v = contexts.get(r, (key[:0], value[:0]))
            all_k = torch.cat([old_k, key[offset:offset + n]])
            all_v = torch.cat([old_v, value[offset:offset + n]])
            contexts[r] = (all_k, all_v)
            k = all_k.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)  # [H, S, D]
            v = all_v.repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
            q = query[offset:offset + n].transpose(0, 1)  # [H, n, D]
            scores = q @ k.transpose(1, 2) * scale  # [H, n, S]
            qpos = torch.arange(start, start + n)[:, None]
            kpos = torch.arange(start + n)[None, :]
            allowed = kpos <= qpos
            if window is not None:
                allowed &= kpos > qpos - window
            scores = scores.masked_fill(~allowed, float("-inf"))
            expected = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)  # [n, H, D]
            torch.testing.assert_close(out[offset:offset + n], expected, rtol=1e-5, atol=1e-5)
            offset += n


def test_the_causal_path_serves_only_first_chunks():
    chunks = [SequenceChunk([0, 1], 0, 5), SequenceChunk([2, 3], 0, 7)]
    meta, _ = build_attention_metadata(chunks, BLOCK, "cpu")
    backend = TorchPagedAttention()
    query = torch.randn(12, HEADS, HEAD_DIM)
    kv = torch.randn(12, KV_HEADS, HEAD_DIM)
    cache = KVCache(1, 8, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    backend.forward(0, query, kv, kv, meta, cache, 0.25, None, None)
    assert [group.starts_at_zero for group in backend._groups] == [True]
    later = [SequenceChunk([0, 1], 5, 2)]
    meta, _ = build_attention_metadata(later, BLOCK, "cpu")
    backend.forward(0, query[:2], kv[:2], kv[:2], meta, cache, 0.25, None, None)
    assert [group.starts_at_zero for group in backend._groups] == [False]


@pytest.mark.parametrize("quantized", [None, "int8", "fp8"])
def test_read_context_is_read_blocks_in_request_head_order(quantized):
    cache = KVCache(2, 12, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, "cpu", quantized=quantized)
    slots = torch.arange(12 * BLOCK)
    cache.write(1, torch.randn(12 * BLOCK, KV_HEADS, HEAD_DIM), torch.randn(12 * BLOCK, KV_HEADS, HEAD_DIM), slots)
    block_ids = torch.tensor([7, 2, 9, 0, 11, 4])  # two requests of three blocks
    keys, values = cache.read_context(1, block_ids, 2)
    for got, expected in zip((keys, values), cache.read_blocks(1, block_ids)):
        expected = expected.view(2, 3, KV_HEADS, BLOCK, HEAD_DIM).transpose(1, 2).reshape(2, KV_HEADS, -1, HEAD_DIM)
        assert torch.equal(got, expected)
