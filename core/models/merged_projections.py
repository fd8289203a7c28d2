"""Merged projections: q/k/v into one `qkv_proj`, gate/up into one `gate_up_proj`, after loading.

One product over the concatenated weight reads the activations once and launches one kernel (and
one dequantize + cuBLAS call on the dense path) instead of three or two: a 36-layer decode step
runs 144 quantized products instead of 252, and each merged product is wider, which the GEMV
kernels use better than narrow ones (k/v of a GQA model are only num_kv_heads * head_dim wide).

Checkpoints keep HF's separate names, so weights always load into q_proj/k_proj/v_proj and
gate_proj/up_proj; the engine merges them afterwards. Both weight layouts have the output features
as their leading dimension (nn.Linear weight [N, K]; PackedWeight qweight/scales/zeros [N, ...]), so
merging is a concatenation along it: the merged output's columns are [q | k | v] and [gate | up].
Projections that differ in kind or quantization parameters (bits, group size, zero mode, scale
dtype, act-order permutation) stay separate; the layers run either form.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.core.quant.packed import PackedWeight
from deepinfer.core.quant.quant_linear import QuantLinear


@torch.no_grad()
def merge_projections(model: nn.Module) -> int:
    """Merge q/k/v and gate/up of every decoder layer in place; returns how many merges were made.
    Layers already merged are left as they are, so calling it twice is harmless."""
    merged = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is None:
            qkv = merge_linears([attn.q_proj, attn.k_proj, attn.v_proj])
            if qkv is not None:
                attn.qkv_proj, attn.q_proj, attn.k_proj, attn.v_proj = qkv, None, None, None
                merged += 1
        if mlp.gate_up_proj is None:
            gate_up = merge_linears([mlp.gate_proj, mlp.up_proj])
            if gate_up is not None:
                mlp.gate_up_proj, mlp.gate_proj, mlp.up_proj = gate_up, None, None
                merged += 1
    return merged


def merge_linears(linears: list[nn.Module]) -> nn.Module | None:
    """One module computing the linears' outputs side by side ([..., N1 + N2 + ...]), or None when
    they cannot be merged."""
    if all(type(linear) is nn.Linear for linear in linears):
        return _merge_dense(linears)
    if all(isinstance(linear, QuantLinear) for linear in linears):
        return _merge_quantized(linears)
    return None


def _merged_bias(linears: list[nn.Module], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """[sum N] with zeros for the linears without a bias; None when none has one."""
    if all(linear.bias is None for linear in linears):
        return None
    return torch.cat([linear.bias.to(dtype) if linear.bias is not None
                      else torch.zeros(linear.out_features, dtype=dtype, device=device) for linear in linears])


def _merge_dense(linears: list[nn.Linear]) -> nn.Linear | None:
    first = linears[0].weight
    if any(linear.weight.dtype != first.dtype or linear.weight.device != first.device
           or linear.in_features != linears[0].in_features for linear in linears):
        return None
    out_features = sum(linear.out_features for linear in linears)
    bias = _merged_bias(linears, first.dtype, first.device)
    merged = nn.Linear(linears[0].in_features, out_features, bias=bias is not None, dtype=first.dtype,
                       device="meta")
    merged.weight = nn.Parameter(torch.cat([linear.weight for linear in linears]), requires_grad=False)
    if bias is not None:
        merged.bias = nn.Parameter(bias, requires_grad=False)
    return merged


def _merge_quantized(linears: list[QuantLinear]) -> QuantLinear | None:
    packs = [linear.packed for linear in linears]
    first = packs[0]
    for packed in packs[1:]:
        same_perm = (packed.input_perm is None) == (first.input_perm is None) and (
            packed.input_perm is None or torch.equal(packed.input_perm, first.input_perm))
        if (packed.bits, packed.group_size, packed.in_features, packed.zero_mode, packed.scales.dtype,
                packed.zeros.dtype, packed.qweight.device) != (
                first.bits, first.group_size, first.in_features, first.zero_mode, first.scales.dtype,
                first.zeros.dtype, first.qweight.device) or not same_perm:
            return None
    bias_dtype = next((packed.bias.dtype for packed in packs if packed.bias is not None), first.scales.dtype)
    return QuantLinear(PackedWeight(
        qweight=torch.cat([packed.qweight for packed in packs]),
        scales=torch.cat([packed.scales for packed in packs]),
        zeros=torch.cat([packed.zeros for packed in packs]),
        bits=first.bits,
        group_size=first.group_size,
        in_features=first.in_features,
        out_features=sum(packed.out_features for packed in packs),
        zero_mode=first.zero_mode,
        input_perm=first.input_perm,
        bias=_merged_bias(linears, bias_dtype, first.qweight.device),
    ))
