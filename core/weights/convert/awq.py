"""AWQ GEMM checkpoints (AutoAWQ / transformers) -> PackedWeight, bit for bit.

AWQ's GEMM layout, per linear with in_features K, out_features N and G groups:
    qweight [K, N // 8] int32   codes packed along N, 8 per word, interleaved: nibble i of word c
                                holds output column 8c + AWQ_ORDER[i]
    qzeros  [G, N // 8] int32   zero points, packed the same way
    scales  [G, N] fp16
and dequantizes as W[n, k] = (q[k, n] - zero[k // G, n]) * scales[k // G, n].
With `zero_point: false` AutoAWQ quantizes symmetrically; its GEMM packing stores unsigned codes
with the fixed zero point 2**(bits-1), so qzeros may be absent and the zero point is then 8.
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

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column (within 8) held by nibble i
_NIBBLE_OF_COLUMN = tuple(AWQ_ORDER.index(column) for column in range(8))


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, N // 8] in AWQ's interleaved order -> codes int32 [R, N] in column order."""
    nibbles = unpack_codes(packed, 4).reshape(packed.shape[0], -1, 8)  # [R, N // 8, nibble]
    return nibbles[..., list(_NIBBLE_OF_COLUMN)].reshape(packed.shape[0], -1)


def awq_to_packed(
    qweight: torch.Tensor,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    group_size: int,
    name: str = "linear",
) -> PackedWeight:
    """One AWQ GEMM linear -> PackedWeight whose dequantization equals AWQ's exactly."""
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ModelLoadError(f"{name}.qweight must be 2-D int32")
    in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
    group_size = in_features if group_size == -1 else group_size
    if group_size <= 0 or in_features % group_size:
        raise ModelLoadError(f"{name}: group size {group_size} does not divide in_features {in_features}")
    num_groups = in_features // group_size
    if tuple(scales.shape) != (num_groups, out_features):
        raise ModelLoadError(f"{name}.scales has shape {tuple(scales.shape)}, expected {(num_groups, out_features)} "
                             f"for qweight {tuple(qweight.shape)} with group size {group_size}")
    if qzeros is not None and tuple(qzeros.shape) != (num_groups, out_features // 8):
        raise ModelLoadError(f"{name}.qzeros has shape {tuple(qzeros.shape)}, "
                             f"expected {(num_groups, out_features // 8)}")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ModelLoadError(f"{name}.bias has shape {tuple(bias.shape)}, expected ({out_features},)")
    codes = unpack_awq(qweight).T.contiguous()  # [N, K]
    stored_scales = exact_scales(scales.T.contiguous())  # [N, G]
    if qzeros is None:
        zeros = torch.full_like(stored_scales, 8)
    else:
        zeros = unpack_awq(qzeros).T.to(stored_scales.dtype)  # [N, G]
    try:
        return pack_weight(codes, stored_scales, zeros, 4, bias=bias)
    except ValueError as err:
        raise ModelLoadError(f"{name}: {err}") from None


class AWQSource(SafetensorsDirSource):
    kind = "awq"

    def __init__(self, path: Path, options: ConvertOptions) -> None:
        quant_config = self._open_quantized(path, options, "quant_config.json")
        bits = int(quant_config.get("bits", quant_config.get("w_bit", 0)))
        self.group_size = int(quant_config.get("group_size", quant_config.get("q_group_size", 128)))
        version = str(quant_config.get("version", "gemm")).lower()
        self.zero_point = bool(quant_config.get("zero_point", True))
        if bits != 4:
            raise UnsupportedModelError(f"{path}: AWQ {bits}-bit is not supported (AWQ GEMM is 4-bit)")
        if version != "gemm":
            raise UnsupportedModelError(f"{path}: AWQ version {version!r} is not supported (only 'gemm')")
        self._scheme = {"method": "awq", "bits": bits, "group_size": self.group_size, "version": version,
                        "zero_point": self.zero_point}

    def convert_layer(self, index: int, summary: ConversionSummary) -> ConvertedLayer:
        modules, others = split_layer(self.files, index, "qweight")
        packed = {}
        for module in modules:
            qzeros_name = f"{module}.qzeros"
            if qzeros_name not in self.files and self.zero_point:
                raise ModelLoadError(f"{self.files.path}: {module} has no qzeros but zero_point is true")
            if f"{module}.scales" not in self.files:
                raise ModelLoadError(f"{self.files.path}: {module} has qweight but no scales")
            packed[module] = awq_to_packed(
                self.files.get(f"{module}.qweight"),
                self.files.get(qzeros_name) if qzeros_name in self.files else None,
                self.files.get(f"{module}.scales"),
                self.files.get(f"{module}.bias") if f"{module}.bias" in self.files else None,
                group_size=self.group_size, name=module)
            record_packed(summary, self.files, module, packed[module], "awq-int4")
        return ConvertedLayer(dense=keep_tensors(self.files, others, summary), packed=packed)
