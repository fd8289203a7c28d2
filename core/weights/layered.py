"""deepinfer's layered checkpoint: one safetensors file per decoder layer, packed W4A16/W3A16 linears.

This module reads and writes the format only; core/models/loader.py builds the model from it.
See docs/FORMAT.md for the layout. Writing goes to a temp directory beside the output that is
renamed into place only when every file is written, so a failed conversion leaves nothing behind.
Reading checks each file's sha256 against the manifest as it loads it, one layer at a time, so
peak host memory stays near one layer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save as save_safetensors_bytes

from deepinfer.core.errors import ConversionError, ModelLoadError
from deepinfer.core.quant.packed import PackedWeight

FORMAT_NAME = "deepinfer-layered"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
CONFIG_FILE = "config.json"
EMBEDDINGS_FILE = "embeddings.safetensors"
PACKED_FIELDS = ("qweight", "scales", "zeros", "input_perm", "bias")
_RESERVED_METADATA = ("format", "format_version", "layer_index")


def layer_file(index: int) -> str:
    return f"layers/layer_{index:05d}.safetensors"


def sha256_of_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


class LayeredWriter:
    """Writes a layered checkpoint into `<out>.tmp-*` beside `out`; `finish` renames it to `out`.

    Use as a context manager: leaving the block on an exception removes the temp directory.
    """

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.out = Path(out_dir)
        if self.out.exists():
            raise ConversionError(f"output {self.out} already exists; give a new directory (nothing was written)")
        parent = self.out.absolute().parent
        if not parent.is_dir():
            raise ConversionError(f"cannot write {self.out}: its parent directory {parent} does not exist")
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=parent))
        (self.tmp / "layers").mkdir()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)

    @property
    def directory(self) -> Path:
        """Where files go until `finish` (tokenizers save themselves here)."""
        return self.tmp

    def write_json(self, name: str, obj: Any) -> None:
        (self.tmp / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")

    def write_layer(self, index: int, dense: dict[str, torch.Tensor], packed: dict[str, PackedWeight]) -> int:
        """dense: norms (and linears kept unquantized) by HF name; packed: quantized linears by module name.

        Returns the bytes written.
        """
        tensors = dict(dense)
        metadata = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "layer_index": str(index)}
        for name, weight in packed.items():
            for field in PACKED_FIELDS:
                value = getattr(weight, field)
                if value is not None:
                    tensors[f"{name}.{field}"] = value
            metadata[name] = json.dumps({
                "bits": weight.bits, "group_size": weight.group_size, "zero_mode": weight.zero_mode,
                "in_features": weight.in_features, "out_features": weight.out_features,
            })
        return self._write_safetensors(layer_file(index), tensors, metadata)

    def write_embeddings(self, dense: dict[str, torch.Tensor]) -> int:
        metadata = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION)}
        return self._write_safetensors(EMBEDDINGS_FILE, dense, metadata)

    def _write_safetensors(self, name: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
        data = save_safetensors_bytes({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, metadata)
        (self.tmp / name).write_bytes(data)
        return len(data)

    def finish(self, manifest: dict[str, Any]) -> Path:
        """Hash every file into the manifest, write it, and move the directory to `out`."""
        files = {}
        for path in sorted(p for p in self.tmp.rglob("*") if p.is_file()):
            rel = path.relative_to(self.tmp).as_posix()
            files[rel] = {"sha256": sha256_of_file(path), "bytes": path.stat().st_size}
        manifest = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **manifest, "files": files}
        self.write_json(MANIFEST_FILE, manifest)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.tmp, 0o777 & ~umask)  # mkdtemp made it private; the result is an ordinary directory
        try:
            os.rename(self.tmp, self.out)  # atomic on one filesystem; fails if `out` appeared meanwhile
        except OSError as err:
            raise ConversionError(f"cannot move the finished checkpoint to {self.out}: {err}") from None
        return self.out


def is_layered_checkpoint(path: str | os.PathLike) -> bool:
    manifest = Path(path) / MANIFEST_FILE
    if not manifest.is_file():
        return False
    try:
        return json.loads(manifest.read_text()).get("format") == FORMAT_NAME
    except (ValueError, OSError, AttributeError):
        return False


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """manifest.json of a layered checkpoint, checked for format, version and required fields."""
    manifest_path = Path(path) / MANIFEST_FILE
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: not a deepinfer layered checkpoint (no {MANIFEST_FILE})") from None
    except (ValueError, OSError) as err:
        raise ModelLoadError(f"{manifest_path}: unreadable manifest: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ModelLoadError(f"{manifest_path}: format is not {FORMAT_NAME!r}")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ModelLoadError(f"{manifest_path}: format version {version!r} is not supported "
                             f"(this deepinfer reads version {FORMAT_VERSION})")
    if not isinstance(manifest.get("files"), dict) or not isinstance(manifest.get("num_layers"), int):
        raise ModelLoadError(f"{manifest_path}: manifest lacks 'files' or 'num_layers'")
    return manifest


def read_checked_bytes(path: str | os.PathLike, name: str, manifest: dict[str, Any]) -> bytes:
    """The bytes of file `name`, after checking them against the manifest's size and sha256."""
    entry = manifest["files"].get(name)
    if entry is None:
        raise ModelLoadError(f"{path}: manifest does not list {name}")
    try:
        data = (Path(path) / name).read_bytes()
    except OSError as err:
        raise ModelLoadError(f"{path}: cannot read {name}: {err}") from None
    if len(data) != entry.get("bytes") or hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        raise ModelLoadError(f"{Path(path) / name}: size or sha256 does not match the manifest "
                             f"(truncated or modified file)")
    return data


def _load_safetensors(path: str | os.PathLike, name: str, manifest: dict[str, Any]
                      ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    data = read_checked_bytes(path, name, manifest)
    try:
        tensors = load_safetensors_bytes(data)
        header_len = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8:8 + header_len]).get("__metadata__", {})
    except (SafetensorError, ValueError) as err:
        raise ModelLoadError(f"{Path(path) / name}: malformed safetensors: {err}") from None
    return tensors, metadata


def read_layer(path: str | os.PathLike, index: int, manifest: dict[str, Any]
               ) -> tuple[dict[str, torch.Tensor], dict[str, PackedWeight]]:
    """(dense tensors by HF name, PackedWeights by linear module name) of decoder layer `index`."""
    name = layer_file(index)
    tensors, metadata = _load_safetensors(path, name, manifest)
    if metadata.get("layer_index") != str(index):
        raise ModelLoadError(f"{Path(path) / name}: holds layer {metadata.get('layer_index')!r}, expected {index}")
    packed = {}
    for linear, fields_json in metadata.items():
        if linear in _RESERVED_METADATA:
            continue
        try:
            fields = json.loads(fields_json)
            parts = {field: tensors.pop(f"{linear}.{field}", None) for field in PACKED_FIELDS}
            if parts["qweight"] is None or parts["scales"] is None or parts["zeros"] is None:
                raise ValueError("qweight, scales or zeros is missing")
            packed[linear] = PackedWeight(**parts, bits=fields["bits"], group_size=fields["group_size"],
                                          in_features=fields["in_features"], out_features=fields["out_features"],
                                          zero_mode=fields["zero_mode"])
        except (ValueError, KeyError, TypeError) as err:
            raise ModelLoadError(f"{Path(path) / name}: quantized linear {linear!r} is malformed: {err}") from None
    return tensors, packed


def read_embeddings(path: str | os.PathLike, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor outside the decoder layers: embed_tokens, final norm, lm_head when not tied."""
    return _load_safetensors(path, EMBEDDINGS_FILE, manifest)[0]

