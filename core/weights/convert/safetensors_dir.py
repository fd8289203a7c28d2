"""An HF checkpoint directory (config.json + one or more safetensors shards), read lazily by tensor name.

The GPTQ, AWQ and plain-HF sources all read their tensors through this. The directory is checked
as the loader checks it: config.json within ModelSpec's bounds, index entries plain relative
paths, shards and tokenizer files regular files inside the directory, the layers that hold
tensors exactly 0 .. num_hidden_layers - 1.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from deepinfer.core.errors import ModelLoadError, UnsupportedModelError
from deepinfer.core.models.spec import ModelSpec
from deepinfer.core.quant.packed import PackedWeight
from deepinfer.core.weights.convert.source import (
    LINEAR_NAMES,
    ConversionSource,
    ConvertOptions,
    packed_nbytes,
    target_type,
)
from deepinfer.core.weights.convert.summary import EXACT, KEPT, ConversionSummary, TensorRecord
from deepinfer.core.weights.file_checks import (
    MAX_TOKENIZER_FILE_BYTES,
    TOKENIZER_FILES,
    checked_file,
    confinement_root,
    member_path,
    read_checked_file,
)
from deepinfer.core.weights.hf_safetensors import read_json

_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class SafetensorsDir:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.root = confinement_root(path)
        self.config = read_json(path / "config.json")
        self.spec = ModelSpec.from_hf_config(self.config, where=str(path / "config.json"))
        index_path = path / "model.safetensors.index.json"
        if index_path.is_file():
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelLoadError(f"{index_path}: no 'weight_map'")
            for name in set(weight_map.values()):
                member_path(path, name, f"{index_path}: weight_map")
            shard_names = sorted(set(weight_map.values()))
        else:
            shard_names = sorted(p.name for p in path.glob("*.safetensors"))
            if not shard_names:
                raise ModelLoadError(f"{path}: no *.safetensors files")
        self._handles = {}
        self._file_of: dict[str, str] = {}
        for shard in shard_names:
            checked_file(path / shard, root=self.root, what="weight shard")
            try:
                handle = safe_open(str(path / shard), framework="pt")
            except (SafetensorError, OSError) as err:
                raise ModelLoadError(f"{path / shard}: unreadable safetensors file (truncated?): {err}") from None
            self._handles[shard] = handle
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                self._file_of[name] = shard
        self.layer_names: dict[int, list[str]] = defaultdict(list)
        self.other_names: list[str] = []
        for name in sorted(self._file_of):
            match = _LAYER_NAME.match(name)
            if match:
                self.layer_names[int(match.group(1))].append(name)
            else:
                self.other_names.append(name)
        num_layers = self.spec.num_layers
        extra = sorted(i for i in self.layer_names if i >= num_layers)
        if extra:
            raise ModelLoadError(f"{path}: tensors of layer {extra[0]} but config.json says {num_layers} layers")
        missing = [i for i in range(num_layers) if i not in self.layer_names]
        if missing:
            raise ModelLoadError(f"{path / 'config.json'}: num_hidden_layers is {num_layers}, but no tensor of "
                                 f"layer {missing[0]} is in the weights")

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        shard = self._file_of.get(name)
        if shard is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is missing")
        try:
            return self._handles[shard].get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as err:
            raise ModelLoadError(f"{self.path / shard}: cannot read tensor {name!r} (truncated file?): {err}") from None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, as the headers declare it."""
        return {name: tuple(self.shape(name)) for name in self._file_of}

    def names_under(self, module: str) -> list[str]:
        return [name for name in self._file_of if name.startswith(module + ".")]

    def shape(self, name: str) -> list[int]:
        return list(self._handles[self._file_of[name]].get_slice(name).get_shape())

    def nbytes(self, name: str) -> int:
        numel = 1
        for dim in self.shape(name):
            numel *= dim
        return numel * _DTYPE_BYTES.get(self.dtype_name(name), 4)

    def dtype_name(self, name: str) -> str:
        return self._handles[self._file_of[name]].get_slice(name).get_dtype()

    def copy_tokenizer(self, directory: Path) -> None:
        """Copy the tokenizer files there are (each checked and read with a size bound)."""
        for file_name in TOKENIZER_FILES:
            if os.path.lexists(self.path / file_name):
                data = read_checked_file(self.path / file_name, MAX_TOKENIZER_FILE_BYTES, root=self.root,
                                         what="tokenizer file")
                (directory / file_name).write_bytes(data)

    def close(self) -> None:
        self._handles.clear()


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def linear_module_of(name: str) -> str | None:
    """`model.layers.3.mlp.up_proj.qweight` -> `model.layers.3.mlp.up_proj`, or None for a non-linear."""
    module, _, _ = name.rpartition(".")
    return module if module.rpartition(".")[2] in LINEAR_NAMES else None


def unquantized_config(config: dict[str, Any]) -> dict[str, Any]:
    """The source config.json without its quantization_config: the layered dir records that itself."""
    return {k: v for k, v in config.items() if k != "quantization_config"}


def read_quant_config(files: SafetensorsDir, method: str, legacy_file: str) -> dict[str, Any]:
    """config.json's `quantization_config`, or the quantizer's own legacy file beside it."""
    quant_config = files.config.get("quantization_config")
    if quant_config is None and (files.path / legacy_file).is_file():
        quant_config = read_json(files.path / legacy_file)
        quant_config.setdefault("quant_method", method)
    if not isinstance(quant_config, dict):
        raise ModelLoadError(f"{files.path}: no {method.upper()} quantization config (config.json "
                             f"'quantization_config' or {legacy_file})")
    found = str(quant_config.get("quant_method", "")).lower()
    if found != method:
        raise UnsupportedModelError(f"{files.path}: quantization config says quant_method {found!r}, "
                                    f"expected {method!r}")
    return quant_config


def split_layer(files: SafetensorsDir, index: int, marker: str) -> tuple[list[str], list[str]]:
    """(quantized linear modules, i.e. those with a `<module>.<marker>` tensor; every other tensor name)."""
    names = files.layer_names.get(index, [])
    modules = sorted(name[: -len(marker) - 1] for name in names if name.endswith("." + marker))
    module_set = set(modules)
    others = [name for name in names if name.rpartition(".")[0] not in module_set]
    return modules, others


def keep_tensors(files: SafetensorsDir, names: list[str], summary: ConversionSummary) -> dict[str, torch.Tensor]:
    """Tensors copied unchanged in their source dtype (norms, embeddings, unquantized linears)."""
    kept = {}
    for name in names:
        tensor = files.get(name)
        kept[name] = tensor
        nbytes = tensor.numel() * tensor.element_size()
        summary.add(TensorRecord(name, KEPT, files.dtype_name(name), str(tensor.dtype).removeprefix("torch."),
                                 tensor.numel(), nbytes, nbytes))
    return kept


def record_packed(summary: ConversionSummary, files: SafetensorsDir, module: str, packed: PackedWeight,
                  source_type: str) -> None:
    before = sum(files.nbytes(name) for name in files.names_under(module))
    summary.add(TensorRecord(f"{module}.weight", EXACT, source_type, target_type(packed),
                             packed.in_features * packed.out_features, before, packed_nbytes(packed)))


class SafetensorsDirSource(ConversionSource):
    """A source that is an HF-style safetensors directory (GPTQ, AWQ, HF): its config minus any
    quantization_config, its tokenizer files copied, the tensors outside the decoder layers kept as
    stored. Subclasses set `files` and `_scheme` and convert the layers."""

    files: SafetensorsDir
    _scheme: dict[str, Any]

    def _open_quantized(self, path: Path, options: ConvertOptions, legacy_file: str) -> dict[str, Any]:
        """Open a quantizer's export (GPTQ, AWQ) after refusing the options of other source kinds; its
        quantization config (config.json's, or `legacy_file` beside it)."""
        options.reject_for(self.kind)
        self.files = SafetensorsDir(path)
        return read_quant_config(self.files, self.kind, legacy_file)

    @property
    def config(self) -> dict[str, Any]:
        return unquantized_config(self.files.config)

    @property
    def quant_scheme(self) -> dict[str, Any]:
        return self._scheme

    def save_tokenizer(self, directory: Path) -> None:
        self.files.copy_tokenizer(directory)

    def convert_embeddings(self, summary: ConversionSummary) -> dict[str, torch.Tensor]:
        return keep_tensors(self.files, self.files.other_names, summary)

    def close(self) -> None:
        self.files.close()
