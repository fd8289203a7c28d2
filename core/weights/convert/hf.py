"""Plain HF fp16/bf16/fp32 safetensors checkpoints -> round-to-nearest W4A16/W3A16/W8A16 (core/quant/rtn.py)."""

from __future__ import annotations

from pathlib import Path

from deepinfer.core.errors import ConversionError
from deepinfer.core.quant.rtn import default_group_size, quantization_error, quantize_rtn
from deepinfer.core.weights.convert.safetensors_dir import (
    SafetensorsDir,
    SafetensorsDirSource,
    keep_tensors,
    linear_module_of,
)
from deepinfer.core.weights.convert.source import (
    ConvertedLayer,
    ConvertOptions,
    packed_nbytes,
    target_type,
)
from deepinfer.core.weights.convert.summary import REQUANTIZED, ConversionSummary, TensorRecord
from deepinfer.core.weights.tensor_checks import check_tensors_match_spec

DEFAULT_GROUP_SIZE = 128


class HFSource(SafetensorsDirSource):
    kind = "hf"

    def __init__(self, path: Path, options: ConvertOptions) -> None:
        self.files = SafetensorsDir(path)
        # An unquantized source holds exactly the model's parameters: check them before converting any.
        check_tensors_match_spec(self.files.spec, self.files.shapes(), str(path))
        self.bits = options.rtn_bits
        self.group_size = options.group_size  # None: DEFAULT_GROUP_SIZE, or the largest smaller one that divides
        self.sym = options.sym
        if self.bits not in (3, 4, 8):
            raise ConversionError(f"--bits {self.bits} is not supported: deepinfer stores 3-, 4- and 8-bit weights")
        if self.group_size not in (None, 32, 64, 128, -1):
            raise ConversionError(f"--group-size {self.group_size} is not supported: use 32, 64, 128 or -1")
        if options.keep_8bit:
            raise ConversionError("--keep-8bit applies to GGUF sources only (use --bits 8 for round-to-nearest 8-bit)")
        self._scheme = {"method": "rtn", "bits": self.bits, "group_size": self.group_size or DEFAULT_GROUP_SIZE,
                        "sym": self.sym,
                        "source_dtype": str(self.files.config.get("torch_dtype", self.files.config.get("dtype")))}

    def convert_layer(self, index: int, summary: ConversionSummary) -> ConvertedLayer:
        names = self.files.layer_names.get(index, [])
        weights = [n for n in names if n.endswith(".weight") and linear_module_of(n) and len(self.files.shape(n)) == 2]
        modules = {linear_module_of(n) for n in weights}
        packed = {}
        for name in weights:
            module = linear_module_of(name)
            weight = self.files.get(name)
            bias = self.files.get(f"{module}.bias") if f"{module}.bias" in self.files else None
            try:
                group_size = self.group_size or default_group_size(weight.shape[1], DEFAULT_GROUP_SIZE)
                packed[module] = quantize_rtn(weight, self.bits, group_size, self.sym, bias=bias)
            except ValueError as err:
                raise ConversionError(f"{name}: {err}") from None
            max_error, mean_error = quantization_error(weight, packed[module])
            before = weight.numel() * weight.element_size() + (0 if bias is None else bias.numel() * bias.element_size())
            summary.add(TensorRecord(name, REQUANTIZED, self.files.dtype_name(name), target_type(packed[module]),
                                     weight.numel(), before, packed_nbytes(packed[module]), max_error, mean_error))
        others = [n for n in names if n.rpartition(".")[0] not in modules]
        return ConvertedLayer(dense=keep_tensors(self.files, others, summary), packed=packed)
