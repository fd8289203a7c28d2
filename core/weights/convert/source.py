"""What every conversion source provides, and the options `deepinfer convert` passes to it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer.core.errors import ConversionError
from deepinfer.core.quant.packed import PackedWeight
from deepinfer.core.weights.convert.summary import ConversionSummary
from deepinfer.core.weights.generation_defaults import GenerationDefaults

# The decoder's projections, by HF's leaf module name: the only tensors that are ever quantized.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ConvertOptions:
    bits: int | None = None  # round-to-nearest bits, 3, 4 or 8 (HF sources, requantized GGUF tensors); default 4
    group_size: int | None = None  # round-to-nearest group; default 128 for HF, 32 for GGUF; -1 per-channel
    sym: bool = False  # symmetric round-to-nearest (zero point 2**(bits-1)) instead of min/max
    keep_8bit: bool = False  # GGUF: Q8_0 exactly to 8 bits, the other non-4-bit types re-quantized to 8 bits
    # GGUF, as the loader runs a file directly: float (F32/F16/BF16) projections stay dense and every dense
    # tensor stays float32 (the model's dtype decides, as on the dequantizing path), so nothing loses bits.
    dense_float: bool = False

    @property
    def rtn_bits(self) -> int:
        return 4 if self.bits is None else self.bits

    def reject_for(self, kind: str) -> None:
        """GPTQ and AWQ are re-packed exactly as stored: round-to-nearest options make no sense there."""
        given = [flag for flag, is_set in (("--bits", self.bits is not None), ("--group-size", self.group_size is not None),
                                           ("--sym", self.sym), ("--keep-8bit", self.keep_8bit)) if is_set]
        if given:
            raise ConversionError(f"{', '.join(given)}: not for {kind.upper()} sources, whose weights are "
                                  f"re-packed exactly as quantized")


@dataclass
class ConvertedLayer:
    dense: dict[str, torch.Tensor]  # HF name -> tensor (norms; linears kept unquantized)
    packed: dict[str, PackedWeight]  # linear module name (`model.layers.0.self_attn.q_proj`) -> PackedWeight


class ConversionSource(ABC):
    """One checkpoint being converted; read lazily so that only one layer is in memory at a time."""

    kind: str  # "gptq" | "awq" | "gguf" | "hf"

    @property
    @abstractmethod
    def config(self) -> dict[str, Any]:
        """HF-style config.json for the converted model (ModelSpec.from_hf_config reads it)."""

    @property
    @abstractmethod
    def quant_scheme(self) -> dict[str, Any]:
        """The source's quantization, as recorded in the manifest."""

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @abstractmethod
    def save_tokenizer(self, directory: Path) -> None:
        """Write tokenizer.json / tokenizer_config.json (and chat template) into `directory`."""

    def generation_defaults(self) -> GenerationDefaults:
        """Sampling defaults to write as generation_config.json; none where the source's own file is
        copied with the tokenizer (HF, GPTQ, AWQ directories)."""
        return GenerationDefaults()

    @abstractmethod
    def convert_embeddings(self, summary: ConversionSummary) -> dict[str, torch.Tensor]:
        """Every tensor outside the decoder layers (embed_tokens, final norm, lm_head), unquantized."""

    @abstractmethod
    def convert_layer(self, index: int, summary: ConversionSummary) -> ConvertedLayer:
        """Decoder layer `index`: its linears packed, its norms kept."""

    def close(self) -> None:
        """Release open files."""


def packed_nbytes(packed: PackedWeight) -> int:
    return sum(t.numel() * t.element_size() for t in
               (packed.qweight, packed.scales, packed.zeros, packed.input_perm, packed.bias) if t is not None)


def target_type(packed: PackedWeight) -> str:
    group = "channel" if packed.group_size == packed.in_features else f"g{packed.group_size}"
    scale = "" if packed.scales.dtype == torch.float16 else "-f32scale"
    return f"int{packed.bits}-{group}{scale}"


def exact_scales(scales: torch.Tensor) -> torch.Tensor:
    """scales in the smallest dtype PackedWeight allows that keeps them exact: fp16, else fp32."""
    if scales.dtype == torch.float16:
        return scales
    as_fp32 = scales.to(torch.float32)
    as_fp16 = as_fp32.to(torch.float16)
    return as_fp16 if torch.equal(as_fp16.to(torch.float32), as_fp32) else as_fp32
