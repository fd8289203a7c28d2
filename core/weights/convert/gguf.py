"""GGUF files -> PackedWeight: Q4_0, Q4_1 and Q4_K exactly to 4 bits; other types re-quantized.

With --keep-8bit (or --bits 8) Q8_0 is re-packed exactly to 8 bits and the other non-exact types
(Q5_K, Q6_K, F16, ...) are re-quantized to 8 bits; otherwise they go to 4 (or --bits 3) bits.
With ConvertOptions.dense_float (the loader's direct load) F32/F16/BF16 projections stay dense.
The blocks are decoded here, straight from the bytes (the layouts of ggml-quants.c):
    Q4_0  18 B / 32 weights:  d fp16, 16 B nibbles        W = (q - 8) * d
    Q4_1  20 B / 32 weights:  d fp16, m fp16, 16 B        W = q * d + m
          (byte j of the nibbles holds weight j in its low and weight j + 16 in its high nibble)
    Q4_K 144 B / 256 weights: d fp16, dmin fp16, 12 B of 6-bit sub-scales sc[8] and sub-mins m[8],
          128 B nibbles (32-byte chunk c: low nibbles = sub-block 2c, high = 2c + 1)
                                                      W = (d * sc) * q - (dmin * m)   per 32 weights
    Q8_0  34 B / 32 weights:  d fp16, 32 signed bytes qs  W = qs * d, stored as code qs + 128, zero 128
Q4_K's d * sc and dmin * m are exact in float32 but not in fp16, so its scales and zeros are fp32.
Tensor names, the config and the llama Q/K row order follow core/weights/gguf_reader.py, the
models' own GGUF path, so a converted model computes what the GGUF path computes. The Q/K
permutation is on output rows, so it moves packed rows together with their scales and zeros.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepinfer.core.errors import ConversionError, UnsupportedModelError
from deepinfer.core.models.spec import ModelSpec
from deepinfer.core.quant.packed import PackedWeight
from deepinfer.core.quant.packing import pack_weight
from deepinfer.core.quant.rtn import quantization_error, quantize_rtn
from deepinfer.core.weights.convert.source import (
    LINEAR_NAMES,
    ConversionSource,
    ConvertedLayer,
    ConvertOptions,
    packed_nbytes,
    target_type,
)
from deepinfer.core.weights.convert.summary import EXACT, KEPT, REQUANTIZED, ConversionSummary, TensorRecord
from deepinfer.core.weights.generation_defaults import GenerationDefaults, gguf_generation_defaults
from deepinfer.core.weights.gguf_reader import (
    ROPE_FREQS,
    gguf_metadata_to_hf_config,
    gguf_to_hf_name,
    layer_norm_names,
    open_gguf,
    read_field,
)

EXACT_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # re-packed exactly to 4 bits
EXACT_8BIT_TYPES = ("Q8_0",)  # re-packed exactly to 8 bits, with --keep-8bit
FLOAT_TYPES = ("F32", "F16", "BF16")  # kept dense with ConvertOptions.dense_float
DEFAULT_REQUANT_GROUP_SIZE = 32  # GGUF's own block granularity


def _fp16(raw: np.ndarray) -> torch.Tensor:
    """uint8 [..., 2] little-endian fp16 bytes -> float16 [...]."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].copy())


def _split_nibbles(qs: np.ndarray) -> np.ndarray:
    """uint8 [..., 16] -> codes [..., 32]: weight j in the low nibble of byte j, weight j + 16 in its high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def decode_q4_0(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """blocks uint8 [N, K // 32, 18] -> codes [N, K], scales [N, K // 32], zeros [N, K // 32], zero_mode."""
    rows = blocks.shape[0]
    scales = _fp16(blocks[..., 0:2])
    codes = torch.from_numpy(_split_nibbles(blocks[..., 2:18]).reshape(rows, -1).astype(np.int32))
    return codes, scales, torch.full_like(scales, 8), "zero"


def decode_q4_1(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """blocks uint8 [N, K // 32, 20] -> codes, scales (d), zeros (the min m), zero_mode "min"."""
    rows = blocks.shape[0]
    codes = torch.from_numpy(_split_nibbles(blocks[..., 4:20]).reshape(rows, -1).astype(np.int32))
    return codes, _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4]), "min"


def q4_k_sub_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [..., 12] -> 6-bit sub-scales [..., 8] and sub-mins [..., 8].

    Sub-blocks 0-3 keep their scale and min in the low 6 bits of bytes 0-3 and 4-7; sub-blocks 4-7
    keep the low 4 bits in bytes 8-11 (scale low nibble, min high nibble) and the top 2 bits in the
    spare high bits of bytes 0-3 (scale) and 4-7 (min).
    """
    low, high, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([low & 0x3F, (extra & 0x0F) | ((low >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([high & 0x3F, (extra >> 4) | ((high >> 2) & 0x30)], axis=-1)
    return scales, mins


def decode_q4_k(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """blocks uint8 [N, K // 256, 144] -> codes [N, K], scales and zeros [N, K // 32] float32, "min"."""
    rows = blocks.shape[0]
    d = _fp16(blocks[..., 0:2]).to(torch.float32)[..., None]  # [N, B, 1]
    dmin = _fp16(blocks[..., 2:4]).to(torch.float32)[..., None]
    sub_scales, sub_mins = q4_k_sub_scales(blocks[..., 4:16])  # [N, B, 8] each
    scales = d * torch.from_numpy(sub_scales.astype(np.float32))  # exact: 11-bit mantissa times 6 bits
    zeros = -(dmin * torch.from_numpy(sub_mins.astype(np.float32)))
    chunks = blocks[..., 16:144].reshape(*blocks.shape[:2], 4, 32)  # [N, B, chunk, 32]
    codes = np.stack([chunks & 0x0F, chunks >> 4], axis=-2)  # [N, B, chunk, low/high, 32]
    codes = torch.from_numpy(codes.reshape(rows, -1).astype(np.int32))
    return codes, scales.reshape(rows, -1), zeros.reshape(rows, -1), "min"


def decode_q8_0(blocks: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """blocks uint8 [N, K // 32, 34] -> codes qs + 128 in [0, 256) [N, K], scales (d), zeros 128, "zero".

    (code - 128) * d is qs * d exactly in float32, as gguf-py and ggml compute it.
    """
    rows = blocks.shape[0]
    scales = _fp16(blocks[..., 0:2])
    signed = np.ascontiguousarray(blocks[..., 2:34]).view(np.int8)  # [N, B, 32]
    codes = torch.from_numpy(signed.reshape(rows, -1).astype(np.int32) + 128)
    return codes, scales, torch.full_like(scales, 128), "zero"


# type -> (decoder, weights per block, bytes per block, bits of the codes)
_DECODERS = {"Q4_0": (decode_q4_0, 32, 18, 4), "Q4_1": (decode_q4_1, 32, 20, 4), "Q4_K": (decode_q4_k, 256, 144, 4),
             "Q8_0": (decode_q8_0, 32, 34, 8)}


def gguf_exact_to_packed(data: np.ndarray, type_name: str, out_features: int, in_features: int,
                         row_order: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> PackedWeight:
    """The raw bytes of a Q4_0 / Q4_1 / Q4_K / Q8_0 tensor [N, K] -> PackedWeight, optionally with rows reordered."""
    decode, block_weights, block_bytes, bits = _DECODERS[type_name]
    blocks = np.asarray(data, dtype=np.uint8).reshape(out_features, in_features // block_weights, block_bytes)
    codes, scales, zeros, zero_mode = decode(blocks)
    if row_order is not None:
        codes, scales, zeros = codes[row_order], scales[row_order], zeros[row_order]
    return pack_weight(codes, scales, zeros, bits, zero_mode=zero_mode, bias=bias)


def qk_row_order(num_rows: int, num_heads: int) -> torch.Tensor:
    """Rows of llama.cpp's Q/K (pairs interleaved per head) in HF's rotate-half order: hf = gguf[order]."""
    half = num_rows // num_heads // 2
    return torch.arange(num_rows).reshape(num_heads, half, 2).transpose(1, 2).reshape(-1)


class GGUFSource(ConversionSource):
    kind = "gguf"

    def __init__(self, path: Path, options: ConvertOptions) -> None:
        self.path = path
        self.reader = open_gguf(path)
        self._config = gguf_metadata_to_hf_config(self.reader)
        self.spec = ModelSpec.from_hf_config(self._config)
        self.options = options
        self.group_size = DEFAULT_REQUANT_GROUP_SIZE if options.group_size is None else options.group_size
        if options.rtn_bits not in (3, 4, 8):
            raise ConversionError(f"--bits {options.rtn_bits} is not supported: deepinfer stores 3-, 4- and 8-bit weights")
        if options.keep_8bit and options.bits not in (None, 8):
            raise ConversionError(f"--keep-8bit stores 8-bit weights: it does not go with --bits {options.bits}")
        # --bits 8 is --keep-8bit: Q8_0 would otherwise be re-quantized to the 8 bits it already has
        self.keep_8bit = options.keep_8bit or options.rtn_bits == 8
        self.bits = 8 if self.keep_8bit else options.rtn_bits  # of the re-quantized tensors
        self.exact_types = EXACT_TYPES + (EXACT_8BIT_TYPES if self.keep_8bit else ())
        if self.group_size not in (32, 64, 128, -1):
            raise ConversionError(f"--group-size {self.group_size} is not supported: use 32, 64, 128 or -1")
        norm_names = layer_norm_names(self.spec)
        # rope_freqs (Llama 3 RoPE scaling) is not a weight: the config carries its factors
        self.tensors: dict[str, Any] = {gguf_to_hf_name(t.name, norm_names): t for t in self.reader.tensors
                                        if t.name != ROPE_FREQS}
        types = sorted({t.tensor_type.name for t in self.reader.tensors})
        self._scheme = {"method": "gguf", "tensor_types": types,
                        "file_type": read_field(self.reader, "general.file_type"),
                        "requantized": {"bits": self.bits, "group_size": self.group_size, "sym": options.sym,
                                        "keep_8bit": self.keep_8bit}}

    @property
    def config(self) -> dict[str, Any]:
        return dict(self._config)

    @property
    def quant_scheme(self) -> dict[str, Any]:
        return self._scheme

    def save_tokenizer(self, directory: Path) -> None:
        """The HF tokenizer transformers builds from the GGUF vocab, merges and chat template (if it has a vocab)."""
        from deepinfer.core.tokenizer import Tokenizer

        if read_field(self.reader, "tokenizer.ggml.model") is None:
            return
        tokenizer = Tokenizer.from_pretrained(self.path.parent, gguf_file=self.path.name)  # the models' own path
        tokenizer.hf_tokenizer.save_pretrained(str(directory))

    def generation_defaults(self) -> GenerationDefaults:
        """The GGUF's general.sampling.* metadata (or deepinfer's values for its default model)."""
        return gguf_generation_defaults(self.reader, self.path)

    def convert_embeddings(self, summary: ConversionSummary) -> dict[str, torch.Tensor]:
        names = [name for name in self.tensors if not name.startswith("model.layers.")]
        return {name: self._keep(name, summary) for name in names}

    def convert_layer(self, index: int, summary: ConversionSummary) -> ConvertedLayer:
        prefix = f"model.layers.{index}."
        names = [name for name in self.tensors if name.startswith(prefix)]
        dense, packed = {}, {}
        for name in names:
            module, _, kind = name.rpartition(".")
            packs = module.rpartition(".")[2] in LINEAR_NAMES and not (
                self.options.dense_float and self.tensors[f"{module}.weight"].tensor_type.name in FLOAT_TYPES)
            if packs and kind == "bias":
                continue  # travels with its weight
            if not packs:
                dense[name] = self._keep(name, summary)
                continue
            bias = self._dequantized(f"{module}.bias") if f"{module}.bias" in self.tensors else None
            packed[module] = self._convert_linear(name, bias, summary)
        return ConvertedLayer(dense=dense, packed=packed)

    def _convert_linear(self, name: str, bias: torch.Tensor | None, summary: ConversionSummary) -> PackedWeight:
        tensor = self.tensors[name]
        type_name = tensor.tensor_type.name
        in_features, out_features = (int(d) for d in tensor.shape)  # GGUF shapes are innermost-first
        row_order = self._row_order(name, out_features)
        before = int(tensor.n_bytes)
        if type_name in self.exact_types:
            packed = gguf_exact_to_packed(tensor.data, type_name, out_features, in_features, row_order, bias)
            summary.add(TensorRecord(name, EXACT, type_name, target_type(packed), in_features * out_features,
                                     before, packed_nbytes(packed)))
            return packed
        weight = self._dequantized(name)
        try:
            packed = quantize_rtn(weight, self.bits, self.group_size, self.options.sym, bias=bias)
        except ValueError as err:
            raise ConversionError(f"{name}: {err}") from None
        max_error, mean_error = quantization_error(weight, packed)
        summary.add(TensorRecord(name, REQUANTIZED, type_name, target_type(packed), weight.numel(), before,
                                 packed_nbytes(packed), max_error, mean_error))
        return packed

    def _row_order(self, name: str, out_features: int) -> torch.Tensor | None:
        if self.spec.family not in ("llama", "mistral") or not name.endswith(("q_proj.weight", "k_proj.weight")):
            return None
        heads = self.spec.num_heads if name.endswith("q_proj.weight") else self.spec.num_kv_heads
        return qk_row_order(out_features, heads)

    def _dequantized(self, name: str) -> torch.Tensor:
        """float32 [rows, cols] (HF orientation, Q/K rows un-permuted) as gguf-py dequantizes it."""
        from gguf.quants import dequantize

        tensor = self.tensors[name]
        try:
            values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        except NotImplementedError as err:
            raise UnsupportedModelError(f"GGUF tensor {tensor.name!r}: {err}") from None
        values = torch.from_numpy(values.reshape([int(d) for d in reversed(tensor.shape)]).copy())
        row_order = self._row_order(name, values.shape[0]) if values.dim() == 2 else None
        return values if row_order is None else values[row_order]

    def _keep(self, name: str, summary: ConversionSummary) -> torch.Tensor:
        """Norms and embeddings: float sources keep their dtype, quantized ones become fp16.

        Norm weights lose gguf_reader's Gemma offset (llama.cpp stores 1 + weight) the same way.
        """
        tensor = self.tensors[name]
        type_name = tensor.tensor_type.name
        values = self._dequantized(name)
        if self.spec.norm_weight_offset and name.endswith("norm.weight"):
            values = values - self.spec.norm_weight_offset
        stored_dtype = torch.float32 if self.options.dense_float else {
            "F32": torch.float32, "BF16": torch.bfloat16}.get(type_name, torch.float16)
        kept = values.to(stored_dtype)
        max_error, mean_error = _abs_error(kept, values) if type_name not in ("F32", "F16", "BF16") else (None, None)
        summary.add(TensorRecord(name, KEPT, type_name, str(stored_dtype).removeprefix("torch."), values.numel(),
                                 int(tensor.n_bytes), kept.numel() * kept.element_size(), max_error, mean_error))
        return kept

    def close(self) -> None:
        self.reader = None


def _abs_error(stored: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    diff = (stored.to(torch.float32) - reference).abs()
    return float(diff.max()), float(diff.mean())
