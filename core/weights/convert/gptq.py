"""GPTQ checkpoints (AutoGPTQ / GPTQModel / transformers) -> PackedWeight, bit for bit.

GPTQ stores, per linear with in_features K, out_features N and G groups:
    qweight [K * bits // 32, N] int32   codes packed along K (the same bit stream as deepinfer's, 3-bit
                                        runs crossing words), so it is our layout transposed
    qzeros  [G, N * bits // 32] int32   zero points packed along N; checkpoint_format "gptq" (v1)
                                        stores zero - 1, wrapping modulo 2**bits; "gptq_v2" the zero
    scales  [G, N] fp16
    g_idx   [K] int32                   group of each input column; with desc_act it is a permutation
                                        of the groups, which we sort into contiguous groups and record
                                        as input_perm
and dequantizes as W[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n]).
"""

from __future__ import annotations

from pathlib import Path

import torch

from deepinfer.core.errors import ModelLoadError, UnsupportedModelError
from deepinfer.core.quant.packed import PackedWeight
from deepinfer.core.quant.packing import pack_weight, unpack_codes
from deepinfer.core.weights.convert.safetensors_dir import (
    SafetensorsDirSource,
    keep_tensors,
    record_packed,
    split_layer,
)
from deepinfer.core.weights.convert.source import ConvertedLayer, ConvertOptions, exact_scales
from deepinfer.core.weights.convert.summary import ConversionSummary

ZERO_CONVENTIONS = {"gptq": "v1", "gptq_v1": "v1", "gptq_v2": "v2"}


def gptq_to_packed(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    bits: int,
    group_size: int,
    zero_convention: str,
    name: str = "linear",
) -> PackedWeight:
    """One GPTQ linear -> PackedWeight whose dequantization equals GPTQ's exactly."""
    if bits not in (3, 4):
        raise UnsupportedModelError(f"{name}: GPTQ {bits}-bit is not supported (deepinfer stores 3 and 4 bits)")
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or qweight.dim() != 2:
        raise ModelLoadError(f"{name}: qweight and qzeros must be 2-D int32")
    in_features, out_features = qweight.shape[0] * 32 // bits, qweight.shape[1]
    if qweight.shape[0] * 32 % bits:
        raise ModelLoadError(f"{name}: qweight has {qweight.shape[0]} rows, not a whole number of {bits}-bit runs")
    group_size = in_features if group_size == -1 else group_size
    if group_size <= 0 or in_features % group_size:
        raise ModelLoadError(f"{name}: group size {group_size} does not divide in_features {in_features}")
    num_groups = in_features // group_size
    expected = {"scales": (num_groups, out_features), "qzeros": (num_groups, out_features * bits // 32)}
    for field, tensor in (("scales", scales), ("qzeros", qzeros)):
        if tuple(tensor.shape) != expected[field]:
            raise ModelLoadError(f"{name}.{field} has shape {tuple(tensor.shape)}, expected {expected[field]} "
                                 f"for qweight {tuple(qweight.shape)} with group size {group_size}")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ModelLoadError(f"{name}.bias has shape {tuple(bias.shape)}, expected ({out_features},)")

    codes = unpack_codes(qweight.T.contiguous(), bits)  # [N, K]
    zeros = unpack_codes(qzeros, bits)  # [G, N]
    if zero_convention == "v1":
        zeros = (zeros + 1) % 2**bits
    input_perm = _contiguous_group_order(g_idx, in_features, group_size, name)
    if input_perm is not None:
        codes = codes[:, input_perm]
    stored_scales = exact_scales(scales.T.contiguous())  # [N, G]
    try:
        return pack_weight(codes, stored_scales, zeros.T.to(stored_scales.dtype), bits,
                           input_perm=input_perm, bias=bias)
    except ValueError as err:
        raise ModelLoadError(f"{name}: {err}") from None


def _contiguous_group_order(g_idx: torch.Tensor | None, in_features: int, group_size: int,
                            name: str) -> torch.Tensor | None:
    """None when g_idx already is k // group_size; else the column order that makes groups contiguous."""
    if g_idx is None:
        return None
    if tuple(g_idx.shape) != (in_features,):
        raise ModelLoadError(f"{name}.g_idx has shape {tuple(g_idx.shape)}, expected ({in_features},)")
    g_idx = g_idx.to(torch.int64)
    contiguous = torch.arange(in_features) // group_size
    if torch.equal(g_idx, contiguous):
        return None
    order = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[order], contiguous):
        raise UnsupportedModelError(f"{name}.g_idx does not give every group exactly {group_size} columns")
    return order.to(torch.int32)


class GPTQSource(SafetensorsDirSource):
    kind = "gptq"

    def __init__(self, path: Path, options: ConvertOptions) -> None:
        quant_config = self._open_quantized(path, options, "quantize_config.json")
        self.bits = int(quant_config.get("bits", 0))
        self.group_size = int(quant_config.get("group_size", -1))
        checkpoint_format = str(quant_config.get("checkpoint_format", "gptq")).lower()
        if checkpoint_format not in ZERO_CONVENTIONS:
            raise UnsupportedModelError(f"{path}: GPTQ checkpoint_format {checkpoint_format!r} is not supported "
                                        f"(supported: gptq, gptq_v2)")
        if self.bits not in (3, 4):
            raise UnsupportedModelError(f"{path}: GPTQ {self.bits}-bit is not supported (deepinfer stores 3 and 4 bits)")
        self.zero_convention = ZERO_CONVENTIONS[checkpoint_format]
        self._scheme = {"method": "gptq", "bits": self.bits, "group_size": self.group_size,
                        "desc_act": bool(quant_config.get("desc_act", False)),
                        "sym": bool(quant_config.get("sym", True)), "checkpoint_format": checkpoint_format}

    def convert_layer(self, index: int, summary: ConversionSummary) -> ConvertedLayer:
        modules, others = split_layer(self.files, index, "qweight")
        packed = {}
        for module in modules:
            parts = {field: self.files.get(f"{module}.{field}") if f"{module}.{field}" in self.files else None
                     for field in ("qweight", "qzeros", "scales", "g_idx", "bias")}
            if parts["qzeros"] is None or parts["scales"] is None:
                raise ModelLoadError(f"{self.files.path}: {module} has qweight but no qzeros or scales")
            packed[module] = gptq_to_packed(**parts, bits=self.bits, group_size=self.group_size,
                                            zero_convention=self.zero_convention, name=module)
            record_packed(summary, self.files, module, packed[module], f"gptq-int{self.bits}")
        return ConvertedLayer(dense=keep_tensors(self.files, others, summary), packed=packed)

