"""Building blocks of the generic decoder: RMSNorm, rotary embedding, gated MLP, attention, one layer.

Every projection is built as a separate `nn.Linear` with HF's name (q_proj, k_proj, v_proj, o_proj,
gate_proj, up_proj, down_proj), so weights load by HF's names and the quantization pass can swap
any of them for a `QuantLinear` with the same in/out features. The engine then merges q/k/v into
`qkv_proj` and gate/up into `gate_up_proj` (core/models/merged_projections.py); the layers run
either form. Norms follow HF's numerics: Llama normalizes in
fp32 then casts back before the weight; Gemma computes `x * (1 + weight)` entirely in fp32.
Norms, gated activations and RoPE go through core/ops (a fused CUDA kernel on GPU, the same torch
math elsewhere); the residual stream is carried beside the hidden states so each residual add
fuses into the norm that follows it, as vLLM does. The attention layer rotates q/k and writes the
new K/V into the paged cache in one op (`rotary_and_cache_write`), then asks the backend only to
attend (`kv_written=True`); in decode steps with a W4 merged q/k/v projection that op runs inside the
product's epilogue (`qkv_rotary_and_cache_write`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from deepinfer.core.errors import ModelLoadError
from deepinfer.core.models.spec import ModelSpec, RopeScaling
from deepinfer.core.ops.activation import act_and_mul, act_and_mul_interleaved
from deepinfer.core.ops.gate_up_activation import gate_up_act_and_mul, interleaved_gate_up_product
from deepinfer.core.ops.norm import rms_norm
from deepinfer.core.ops.qkv_rotary import qkv_rotary_and_cache_write
from deepinfer.core.ops.rotary import rotary_and_cache_write


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, weight_offset: float, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight_offset = weight_offset
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        return rms_norm(x, self.weight, self.eps, self.weight_offset)[0]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual) in one fused op. x, residual: [T, dim]."""
        return rms_norm(x, self.weight, self.eps, self.weight_offset, residual=residual)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim // 2] float32, as HF's ROPE_INIT_FUNCTIONS compute them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "freq_factors":
        if len(scaling.freq_factors) != inv_freq.numel():
            raise ModelLoadError(f"{len(scaling.freq_factors)} RoPE frequency factors for head_dim {head_dim}")
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32)
    # llama3: long wavelengths divided by factor, short kept, the band between smoothly interpolated
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once on the device; indexed by positions."""

    def __init__(self, spec: ModelSpec, max_positions: int, device: Any) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(spec.head_dim, spec.rope_theta, spec.rope_scaling).to(device)
        positions = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2] float32
        # Buffers follow model.to(dtype); HF also casts the fp32 cos/sin to the activation dtype.
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, head_dim // 2] in `dtype` (broadcast over heads)."""
        return self.cos_cache[positions].to(dtype).unsqueeze(1), self.sin_cache[positions].to(dtype).unsqueeze(1)


class GatedMLP(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        hidden, inner, bias = spec.hidden_size, spec.intermediate_size, spec.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias, dtype=dtype, device=device)
        self.up_proj = nn.Linear(hidden, inner, bias=bias, dtype=dtype, device=device)
        self.down_proj = nn.Linear(inner, hidden, bias=bias, dtype=dtype, device=device)
        self.gate_up_proj: nn.Module | None = None  # [gate | up], set by merge_projections
        self.inner = inner
        self.hidden_act = spec.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        if self.gate_up_proj is not None:
            # decode steps: the product's epilogue applies the activation (None where it cannot)
            packed = getattr(self.gate_up_proj, "packed", None)
            fused = gate_up_act_and_mul(x, packed, self.hidden_act)  # [T, I]
            if fused is not None:
                return self.down_proj(fused)
            # a product over the weight's interleaved fragment layout returns gate and up in 8-column blocks
            interleaved = interleaved_gate_up_product(x, packed, self.hidden_act)  # [T, 2 * inner] or None
            if interleaved is not None:
                return self.down_proj(act_and_mul_interleaved(interleaved, self.hidden_act))
            gate_up = self.gate_up_proj(x)  # [T, 2 * inner]: [gate | up]
            gate, up = gate_up[..., :self.inner], gate_up[..., self.inner:]
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(act_and_mul(gate, up, self.hidden_act))  # inner: [T, inner]


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.q_proj = nn.Linear(spec.hidden_size, q_size, bias=spec.qkv_bias, dtype=dtype, device=device)
        self.k_proj = nn.Linear(spec.hidden_size, kv_size, bias=spec.qkv_bias, dtype=dtype, device=device)
        self.v_proj = nn.Linear(spec.hidden_size, kv_size, bias=spec.qkv_bias, dtype=dtype, device=device)
        self.o_proj = nn.Linear(q_size, spec.hidden_size, bias=spec.o_bias, dtype=dtype, device=device)
        self.qkv_proj: nn.Module | None = None  # [q | k | v], set by merge_projections
        self.qkv_sizes = (q_size, kv_size, kv_size)
        # A tensor-parallel rank whose KV heads' query groups it owns only in part computes copies of its own
        # heads in the other slots (core/distributed/shard_plan.py): [kept] slot indices, None = every slot.
        self.register_buffer("kept_heads", None, persistent=False)
        self.q_norm = self.k_norm = None
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, spec.norm_weight_offset, dtype, device)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, spec.norm_weight_offset, dtype, device)
        self.scale = spec.attention_scale
        self.sliding_window = spec.sliding_windows[layer_idx]
        self.softcap = spec.attn_logit_softcap

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: Any,
                attn_metadata: Any, kv_cache: Any) -> torch.Tensor:
        num_tokens = x.shape[0]
        layer = self.layer_idx
        key_cache, value_cache = kv_cache.key_caches[layer], kv_cache.value_caches[layer]
        key_scales, value_scales = ((kv_cache.key_scales[layer], kv_cache.value_scales[layer])
                                    if kv_cache.quantized else (None, None))
        fused = None
        if self.qkv_proj is not None and self.q_norm is None:
            # decode steps: the product's epilogue rotates q/k and writes the cache (None where it cannot)
            fused = qkv_rotary_and_cache_write(x, getattr(self.qkv_proj, "packed", None), self.num_heads,
                                               self.num_kv_heads, self.head_dim, cos, sin, key_cache, value_cache,
                                               attn_metadata.slot_mapping, key_scales, value_scales)
        if fused is not None:
            query, key, value = fused
        else:
            if self.qkv_proj is not None:
                # views of one [T, (H + 2 * KVH) * D] product; the ops below take strided token rows
                query, key, value = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
            else:
                query, key, value = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            query = query.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
            key = key.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
            value = value.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
            if self.q_norm is not None:
                query, key = self.q_norm(query), self.k_norm(key)
            query, key = rotary_and_cache_write(query, key, value, cos, sin, key_cache, value_cache,
                                                attn_metadata.slot_mapping, key_scales, value_scales)
        out = backend.forward(layer, query, key, value, attn_metadata, kv_cache, self.scale, self.sliding_window,
                              self.softcap, kv_written=True)  # [T, H, D]
        if self.kept_heads is not None:
            out = out.index_select(1, self.kept_heads)  # [T, kept, D]
        return self.o_proj(out.reshape(num_tokens, -1))


class DecoderLayer(nn.Module):
    """Pre-norm residual block. With `sandwich_norm` (Gemma 2) HF's `post_attention_layernorm`
    normalizes the attention output and `pre/post_feedforward_layernorm` wrap the MLP; without it
    `post_attention_layernorm` is the pre-MLP norm (Llama naming)."""

    def __init__(self, spec: ModelSpec, layer_idx: int, dtype: torch.dtype, device: Any) -> None:
        super().__init__()
        norm_args = (spec.hidden_size, spec.rms_norm_eps, spec.norm_weight_offset, dtype, device)
        self.self_attn = Attention(spec, layer_idx, dtype, device)
        self.mlp = GatedMLP(spec, dtype, device)
        self.input_layernorm = RMSNorm(*norm_args)
        self.post_attention_layernorm = RMSNorm(*norm_args)
        self.sandwich_norm = spec.sandwich_norm
        if spec.sandwich_norm:
            self.pre_feedforward_layernorm = RMSNorm(*norm_args)
            self.post_feedforward_layernorm = RMSNorm(*norm_args)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                backend: Any, attn_metadata: Any, kv_cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) [T, hidden] each -> this layer's output and the residual stream before it.

        The true stream is `hidden + residual`; the first layer gets residual None.
        """
        if residual is None:
            residual, x = hidden, self.input_layernorm(hidden)
        else:
            x, residual = self.input_layernorm.add_and_norm(hidden, residual)
        attn_out = self.self_attn(x, cos, sin, backend, attn_metadata, kv_cache)
        if self.sandwich_norm:
            x, residual = self.pre_feedforward_layernorm.add_and_norm(self.post_attention_layernorm(attn_out), residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        x, residual = self.post_attention_layernorm.add_and_norm(attn_out, residual)
        return self.mlp(x), residual
