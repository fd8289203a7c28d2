"""load_model: find out what the model path is, read it, and return a ready DecoderModel + tokenizer.

Sources, in the order they are recognized:
- `dummy_weights`: the shape of `configs/shapes/<shape>.json` (an HF config.json; or the config of
  `model` when no shape is given), random weights. Tokenizer: the model's own when `model` has one,
  else the default model's if it is already on disk, else a ByteTokenizer.
- no `model`: the default GGUF (fetched once, see core/weights/default_model.py).
- a `.gguf` file (or a directory holding exactly one): GGUF, dequantized to the model dtype.
- a directory whose manifest.json says `"format": "deepinfer-layered"`: handed to
  `core.weights.layered.load_layered(path, config, device, dtype) -> LoadedModel`.
- a directory with config.json: HF safetensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import torch

from deepinfer.core.config import EngineConfig
from deepinfer.core.errors import ModelLoadError, UnsupportedModelError
from deepinfer.core.models.decoder import DecoderModel
from deepinfer.core.models.spec import ModelSpec
from deepinfer.core.tokenizer import ByteTokenizer, Tokenizer
from deepinfer.core.weights import hf_safetensors
from deepinfer.core.weights.default_model import default_model_path
from deepinfer.core.weights.gguf_reader import iter_gguf_weights, open_gguf

SHAPES_DIR = Path(str(files("deepinfer.configs") / "shapes"))
LAYERED_FORMAT = "deepinfer-layered"


@dataclass
class LoadedModel:
    spec: ModelSpec
    model: DecoderModel
    tokenizer: Tokenizer | ByteTokenizer
    source_kind: str  # "hf" | "gguf" | "layered" | "dummy"
    name: str


def load_model(config: EngineConfig, device: torch.device | str, dtype: torch.dtype) -> LoadedModel:
    if config.dummy_weights:
        return _load_dummy(config, device, dtype)
    path = Path(config.model).expanduser() if config.model else default_model_path()
    kind = detect_source(path)
    if kind == "layered":
        from deepinfer.core.weights.layered import load_layered

        return load_layered(path, config, device, dtype)
    if kind == "gguf":
        return _load_gguf(_gguf_file(path), config, device, dtype)
    return _load_hf(path, config, device, dtype)


def detect_source(path: Path) -> str:
    """"hf" | "gguf" | "layered" for an existing path; ModelLoadError saying what is wrong otherwise."""
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
            return "gguf"
        raise ModelLoadError(f"{path} is neither a .gguf file nor a model directory")
    manifest = path / "manifest.json"
    if manifest.is_file() and hf_safetensors.read_json(manifest).get("format") == LAYERED_FORMAT:
        return "layered"
    if hf_safetensors.is_hf_directory(path):
        return "hf"
    if len(list(path.glob("*.gguf"))) == 1:
        return "gguf"
    raise ModelLoadError(f"no model in {path}: expected config.json + *.safetensors, one .gguf file, "
                         f"or a deepinfer layered manifest.json")


def _load_hf(model_dir: Path, config: EngineConfig, device: Any, dtype: torch.dtype) -> LoadedModel:
    spec = ModelSpec.from_hf_config(hf_safetensors.read_hf_config(model_dir))
    files = hf_safetensors.safetensors_files(model_dir)
    hf_safetensors.check_safetensors_match_spec(spec, files)  # before the model is allocated
    model = _build_model(spec, config, device, dtype)
    model.load_weights(hf_safetensors.iter_safetensors(files))
    tokenizer = _checked_tokenizer(Tokenizer.from_pretrained(
        model_dir, eos_token_ids=spec.eos_token_ids, bos_token_id=spec.bos_token_id), spec, model_dir)
    return LoadedModel(spec, model, tokenizer, "hf", model_dir.name)


def _load_gguf(path: Path, config: EngineConfig, device: Any, dtype: torch.dtype) -> LoadedModel:
    reader = open_gguf(path)
    spec = ModelSpec.from_gguf(reader)
    model = _build_model(spec, config, device, dtype)
    model.load_weights(iter_gguf_weights(reader, spec))
    tokenizer = _checked_tokenizer(Tokenizer.from_pretrained(
        path.parent, gguf_file=path.name, eos_token_ids=spec.eos_token_ids, bos_token_id=spec.bos_token_id),
        spec, path)
    return LoadedModel(spec, model, tokenizer, "gguf", path.stem)


def _load_dummy(config: EngineConfig, device: Any, dtype: torch.dtype) -> LoadedModel:
    tokenizer: Tokenizer | ByteTokenizer | None = None
    if config.shape is not None:
        shape_file = shape_file_path(config.shape)
        spec = ModelSpec.from_hf_config(hf_safetensors.read_json(shape_file))
        name = f"dummy-{shape_file.stem}"
    else:
        path = Path(config.model).expanduser()
        kind = detect_source(path)
        if kind == "gguf":
            spec = ModelSpec.from_gguf(open_gguf(_gguf_file(path)))
        elif kind == "hf":
            spec = ModelSpec.from_hf_config(hf_safetensors.read_hf_config(path))
            tokenizer = Tokenizer.from_pretrained(path, eos_token_ids=spec.eos_token_ids)
        else:
            raise UnsupportedModelError("dummy weights need an HF or GGUF model config, or --shape")
        name = f"dummy-{path.stem}"
    model = _build_model(spec, config, device, dtype)
    model.init_dummy_weights(config.seed)
    if tokenizer is None:
        tokenizer = dummy_tokenizer(spec)
    return LoadedModel(spec, model, tokenizer, "dummy", name)


def _build_model(spec: ModelSpec, config: EngineConfig, device: Any, dtype: torch.dtype) -> DecoderModel:
    max_positions = max(config.max_model_len or 0, spec.max_position_embeddings)
    model = DecoderModel(spec, dtype=dtype, device=device, max_positions=max_positions)
    model.requires_grad_(False)
    return model.eval()


def dummy_tokenizer(spec: ModelSpec) -> Tokenizer | ByteTokenizer:
    """The default model's tokenizer when it is on disk and fits the vocab, else one id per byte."""
    default = default_model_path(download=False)
    if default.is_file():
        tokenizer = Tokenizer.from_pretrained(default.parent, gguf_file=default.name)
        if tokenizer.vocab_size <= spec.vocab_size:
            return tokenizer
    return ByteTokenizer(spec.vocab_size)


def _checked_tokenizer(tokenizer: Tokenizer, spec: ModelSpec, where: Path) -> Tokenizer:
    if tokenizer.vocab_size > spec.vocab_size:
        raise ModelLoadError(f"tokenizer of {where} has {tokenizer.vocab_size} tokens, "
                             f"more than the model's vocab_size {spec.vocab_size}")
    return tokenizer


def shape_file_path(shape: str) -> Path:
    """The config.json behind `--shape`: a name under configs/shapes/ or a path to a .json file."""
    candidate = Path(shape).expanduser()
    if candidate.suffix == ".json" and candidate.is_file():
        return candidate
    shape_file = SHAPES_DIR / f"{shape}.json"
    if not shape_file.is_file():
        known = ", ".join(sorted(p.stem for p in SHAPES_DIR.glob("*.json")))
        raise ModelLoadError(f"unknown shape {shape!r}; known shapes: {known}")
    return shape_file


def _gguf_file(path: Path) -> Path:
    return path if path.is_file() else next(path.glob("*.gguf"))


def _has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == b"GGUF"
    except OSError:
        return False

