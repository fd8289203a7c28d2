"""deepinfer's layered checkpoint: one safetensors file per decoder layer, packed W4A16/W3A16 linears.

This module reads and writes the format only; core/models/loader.py builds the model from it.
See docs/FORMAT.md for the layout. Writing goes to a temp directory beside the output that is
renamed into place only when every file is written and synced (core/weights/convert/staging.py),
so a failed or killed conversion leaves nothing behind.
Reading treats the directory as untrusted: the manifest is read with a size bound and checked
(plain relative names, sizes, sha256 digests, one file per layer); every file is a regular file
inside the directory whose size is compared with the manifest before a byte is hashed; the small
files (config, tokenizer, chat template, generation config) are all verified by sha256 before any
of them is used, and tokenizer files the manifest does not list are refused. Layers are verified
as they load, one at a time, so peak host memory stays near one layer.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save as save_safetensors_bytes

from deepinfer.core.errors import ConversionError, ModelLoadError
from deepinfer.core.models.spec import MAX_LAYERS
from deepinfer.core.quant.packed import PackedWeight
from deepinfer.core.weights.convert.staging import StagingDirectory
from deepinfer.core.weights.file_checks import (
    ADDITIONAL_CHAT_TEMPLATES_DIR,
    MAX_JSON_BYTES,
    TOKENIZER_FILES,
    checked_file,
    confinement_root,
    member_path,
    read_json_file,
)

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
        self._staging = StagingDirectory(self.out)  # removes what killed conversions into `out` left
        self.tmp = self._staging.path
        (self.tmp / "layers").mkdir()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.tmp.exists():
            self._staging.remove()

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
        for path in self._staging.files():
            rel = path.relative_to(self.tmp).as_posix()
            files[rel] = {"sha256": sha256_of_file(path), "bytes": path.stat().st_size}
        manifest = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **manifest, "files": files}
        self.write_json(MANIFEST_FILE, manifest)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.tmp, 0o777 & ~umask)  # mkdtemp made it private; the result is an ordinary directory
        try:
            self._staging.commit()  # fsync, then the atomic rename; fails if `out` appeared meanwhile
        except OSError as err:
            raise ConversionError(f"cannot move the finished checkpoint to {self.out}: {err}") from None
        return self.out


def is_layered_checkpoint(path: str | os.PathLike) -> bool:
    manifest = Path(path) / MANIFEST_FILE
    if not manifest.is_file():
        return False
    try:
        return read_json_file(manifest, MAX_JSON_BYTES, root=confinement_root(Path(path))).get("format") == FORMAT_NAME
    except ModelLoadError:
        return False


_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_FILE_BYTES = 1 << 40  # no file of a checkpoint is a TiB


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """manifest.json of a layered checkpoint, checked: format and version, `num_layers` within
    ModelSpec's bounds, every `files` entry a plain relative name with a byte count and a sha256
    digest, and the config, the embeddings and each layer's file listed."""
    path = Path(path)
    manifest_path = path / MANIFEST_FILE
    if not os.path.lexists(manifest_path):
        raise ModelLoadError(f"{path}: not a deepinfer layered checkpoint (no {MANIFEST_FILE})")
    manifest = read_json_file(manifest_path, MAX_JSON_BYTES, root=confinement_root(path))
    if manifest.get("format") != FORMAT_NAME:
        raise ModelLoadError(f"{manifest_path}: format is not {FORMAT_NAME!r}")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ModelLoadError(f"{manifest_path}: format version {version!r} is not supported "
                             f"(this deepinfer reads version {FORMAT_VERSION})")
    files, num_layers = manifest.get("files"), manifest.get("num_layers")
    if not isinstance(files, dict) or not isinstance(num_layers, int) or isinstance(num_layers, bool):
        raise ModelLoadError(f"{manifest_path}: manifest lacks 'files' or 'num_layers'")
    if not 1 <= num_layers <= MAX_LAYERS:
        raise ModelLoadError(f"{manifest_path}: num_layers is {num_layers}; it must be an integer in "
                             f"[1, {MAX_LAYERS}]")
    for name, entry in files.items():
        member_path(path, name, f"{manifest_path}: files")
        size = entry.get("bytes") if isinstance(entry, dict) else None
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_FILE_BYTES \
                or not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise ModelLoadError(f"{manifest_path}: files[{name!r}] must give 'bytes' (an integer) and "
                                 f"'sha256' (64 hex digits)")
    for name in (CONFIG_FILE, EMBEDDINGS_FILE, *(layer_file(i) for i in range(num_layers))):
        if name not in files:
            raise ModelLoadError(f"{manifest_path}: files does not list {name}")
    return manifest


def read_checked_bytes(path: str | os.PathLike, name: str, manifest: dict[str, Any]) -> bytes:
    """The bytes of file `name`, after checking them against the manifest's size and sha256: a regular
    file inside the checkpoint whose size matches is read (never more than that) and hashed."""
    path = Path(path)
    entry = manifest["files"].get(name)
    if entry is None:
        raise ModelLoadError(f"{path}: manifest does not list {name}")
    file = member_path(path, name, f"{path / MANIFEST_FILE}: files")
    size = checked_file(file, root=confinement_root(path), what="checkpoint file")
    if size != entry["bytes"]:
        raise ModelLoadError(f"{file}: size or sha256 does not match the manifest (it has {size} bytes, "
                             f"the manifest says {entry['bytes']}: truncated or modified file)")
    try:
        with open(file, "rb") as handle:
            data = handle.read(size + 1)
    except OSError as err:
        raise ModelLoadError(f"{path}: cannot read {name}: {err}") from None
    if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise ModelLoadError(f"{file}: size or sha256 does not match the manifest "
                             f"(truncated or modified file)")
    return data


def verify_small_files(path: str | os.PathLike, manifest: dict[str, Any]) -> None:
    """Verify by sha256 every file the manifest lists except the weights (config, tokenizer, chat
    template, generation config: what is read before the layers), and refuse a tokenizer or config
    file present in the directory that the manifest does not list (transformers would read it)."""
    path = Path(path)
    for name in manifest["files"]:
        if name != EMBEDDINGS_FILE and not name.startswith("layers/"):
            read_checked_bytes(path, name, manifest)
    readable = [*TOKENIZER_FILES, CONFIG_FILE]
    extra = path / ADDITIONAL_CHAT_TEMPLATES_DIR
    if extra.is_dir():
        readable += [f"{ADDITIONAL_CHAT_TEMPLATES_DIR}/{p.name}" for p in sorted(extra.iterdir())]
    unlisted = [name for name in readable if os.path.lexists(path / name) and name not in manifest["files"]]
    if unlisted:
        raise ModelLoadError(f"{path / unlisted[0]}: not listed in {MANIFEST_FILE} (added after conversion?); "
                             f"the tokenizer would read it unverified")


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

