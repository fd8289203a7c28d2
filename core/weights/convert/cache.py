"""The cache of conversions the loader makes when it runs a checkpoint directly and the conversion is lossy.

`deepinfer chat --model X.gguf` converts a GGUF's Q5_K / Q6_K (and other non-4-bit, non-Q8_0) projections
to 8 bits by round-to-nearest (core/models/direct_load.py): slower than re-packing, and not the file's own
bits, so its result is kept as a layered checkpoint under `<cache root>/converted/` (DEEPINFER_CACHE_DIR,
else ~/.cache/deepinfer) and the next start loads that. An entry's name is the source's name and a key:
the sha256 of the source's identity (the Hub blob hash when the file is a link into a Hugging Face cache's
blobs/, else its real path, size and modification time), the layered format's version, and the
conversion options, so a changed file, format or option never reads an old entry.

An entry is written by `convert_checkpoint` itself (a temp directory beside it, renamed into place when
complete: core/weights/convert/staging.py), so an interrupted first load leaves only a temp directory,
which no lookup reads and the next conversion into that entry removes. Free space is checked before
anything is written; where it is short the conversion runs in memory and nothing is written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from deepinfer.core.errors import ConversionError
from deepinfer.core.weights.convert.run import ProgressCallback, convert_checkpoint
from deepinfer.core.weights.convert.source import ConvertOptions
from deepinfer.core.weights.default_model import cache_root
from deepinfer.core.weights.layered import FORMAT_VERSION, is_layered_checkpoint

CACHE_SUBDIR = "converted"
FREE_SPACE_MARGIN = 1.1  # the estimate is of the payload; headers, manifest and filesystem blocks on top
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def converted_dir() -> Path:
    return cache_root() / CACHE_SUBDIR


def source_identity(path: Path) -> dict:
    """What decides whether a cached conversion of `path` (a file) is still its conversion."""
    real = Path(os.path.realpath(path))
    if real.parent.name == "blobs":  # a Hugging Face cache: the blob's name is its content hash
        return {"hub_blob": real.name}
    stat = real.stat()
    return {"path": str(real), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def cache_entry(path: Path, options: ConvertOptions) -> Path:
    """The directory a conversion of `path` with `options` is (or would be) cached in."""
    key = json.dumps({"source": source_identity(path), "format_version": FORMAT_VERSION,
                      "options": dataclasses.asdict(options)}, sort_keys=True)
    name = _UNSAFE_NAME.sub("_", path.stem)[:80]
    return converted_dir() / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def cached_entry(path: Path, options: ConvertOptions) -> Path | None:
    """The complete cached conversion of `path`, or None."""
    entry = cache_entry(path, options)
    return entry if is_layered_checkpoint(entry) else None


def free_bytes(directory: Path) -> int:
    """Free bytes on the filesystem that holds (or will hold) `directory`."""
    existing = directory
    while not existing.exists():
        existing = existing.parent
    return shutil.disk_usage(existing).free


def convert_into_cache(path: Path, options: ConvertOptions, estimated_bytes: int,
                       progress: ProgressCallback | None = None) -> Path | None:
    """Convert `path` into its cache entry and return it; None (nothing written) when the filesystem has
    less room than the conversion needs. A conversion of another process that finished first is used."""
    entry = cache_entry(path, options)
    if free_bytes(entry.parent) < estimated_bytes * FREE_SPACE_MARGIN:
        return None
    entry.parent.mkdir(parents=True, exist_ok=True)
    try:
        convert_checkpoint(path, entry, options, progress=progress)
    except ConversionError:
        if not is_layered_checkpoint(entry):  # not a race another load won
            raise
    return entry
