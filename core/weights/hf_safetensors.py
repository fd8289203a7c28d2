"""Read a Hugging Face model directory: config.json and safetensors weights (single or sharded).

Only safetensors are read (never pickles). The safetensors library checks that the header fits
the file and that every tensor's byte range lies inside it; its errors, and a missing shard,
become one-line ModelLoadErrors naming the file. Every file is a regular file inside the model
directory, JSON files are read with a size bound (core/weights/file_checks.py), index entries
are plain relative paths, and `check_safetensors_match_spec` compares the tensors the headers
declare with the model the config describes before that model is allocated.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from deepinfer.core.errors import ModelLoadError
from deepinfer.core.models.spec import MAX_EOS_TOKEN_IDS, ModelSpec
from deepinfer.core.weights.file_checks import checked_file, confinement_root, member_path, read_json_file
from deepinfer.core.weights.tensor_checks import check_tensors_match_spec

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def is_hf_directory(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a regular file inside its folder, read with a size bound."""
    return read_json_file(path)


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    """config.json, with generation_config.json's eos ids merged into `eos_token_id` (a list), checked
    against ModelSpec's bounds here, so that an error names the file's path."""
    config = read_json(model_dir / CONFIG_FILE)
    generation_path = model_dir / "generation_config.json"
    if generation_path.is_file():
        eos_ids = _token_ids(config.get("eos_token_id"), model_dir / CONFIG_FILE) + _token_ids(
            read_json(generation_path).get("eos_token_id"), generation_path)
        if eos_ids:
            config["eos_token_id"] = list(dict.fromkeys(eos_ids))
    ModelSpec.from_hf_config(config, where=str(model_dir / CONFIG_FILE))
    return config


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of the directory: regular files inside it (an index names them by plain
    relative paths), checked to exist."""
    root = confinement_root(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_path}: has no weight_map")
        files = [member_path(model_dir, name, f"{index_path}: weight_map") for name in dict.fromkeys(weight_map.values())]
    elif (model_dir / SINGLE_FILE).is_file():
        files = [model_dir / SINGLE_FILE]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"no safetensors weights in {model_dir} (expected {SINGLE_FILE} or {INDEX_FILE})")
    for file in files:
        checked_file(file, root=root, what=f"weight shard (listed in {INDEX_FILE})" if index_path.is_file()
                     else "weight file")
    return files


def check_safetensors_match_spec(spec: Any, files: list[Path]) -> None:
    """The tensors the files' headers declare are exactly those of `spec`'s model (names, shapes);
    reads the headers only."""
    from safetensors import SafetensorError, safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        except (SafetensorError, OSError, ValueError) as err:
            raise ModelLoadError(f"cannot read safetensors file {file}: {err}") from None
    where = str(files[0].parent / (INDEX_FILE if len(files) > 1 else files[0].name))
    check_tensors_match_spec(spec, shapes, where)


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


def _token_ids(value: Any, where: Path) -> list[int]:
    """eos_token_id of a config file: absent, one id or a list of ids."""
    values = [] if value is None else value if isinstance(value, list) else [value]
    if len(values) > MAX_EOS_TOKEN_IDS or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise ModelLoadError(f"{where}: eos_token_id is {shown}; it must be a token id or a list of them")
    return values
