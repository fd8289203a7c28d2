"""Read a Hugging Face model directory: config.json and safetensors weights (single or sharded).

Only safetensors are read (never pickles). The safetensors library checks that the header fits
the file and that every tensor's byte range lies inside it; its errors, and a missing shard,
become one-line ModelLoadErrors naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from deepinfer.core.errors import ModelLoadError

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def is_hf_directory(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"cannot read {path}: {err}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    """config.json, with generation_config.json's eos ids merged into `eos_token_id` (a list)."""
    config = read_json(model_dir / CONFIG_FILE)
    generation_path = model_dir / "generation_config.json"
    if generation_path.is_file():
        eos_ids = _as_list(config.get("eos_token_id")) + _as_list(read_json(generation_path).get("eos_token_id"))
        if eos_ids:
            config["eos_token_id"] = list(dict.fromkeys(eos_ids))
    return config


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of the directory, checked to exist."""
    if (model_dir / INDEX_FILE).is_file():
        weight_map = read_json(model_dir / INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{model_dir / INDEX_FILE} has no weight_map")
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
    elif (model_dir / SINGLE_FILE).is_file():
        files = [model_dir / SINGLE_FILE]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"no safetensors weights in {model_dir} (expected {SINGLE_FILE} or {INDEX_FILE})")
    for file in files:
        if not file.is_file():
            raise ModelLoadError(f"weight shard {file} listed in {INDEX_FILE} is missing")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor on CPU) for every tensor of every file."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                names = handle.keys()
                for name in names:
                    yield name, handle.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as err:
            raise ModelLoadError(f"cannot read safetensors file {file}: {err}") from None


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]
