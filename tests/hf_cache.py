"""A Hugging Face cache on disk, laid out as huggingface_hub writes it, for tests that run offline.

    <cache>/models--ORG--NAME/blobs/<sha256>                  file contents, one blob per distinct file
    <cache>/models--ORG--NAME/snapshots/<commit>/<path>       relative symlinks into blobs/
    <cache>/models--ORG--NAME/refs/<branch or tag>            the commit hash, no newline
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def add_snapshot(cache: Path, repo_id: str, files: dict[str, Path | bytes], commit: str,
                 refs: tuple[str, ...] = ("main",)) -> Path:
    """Put `files` (repo path -> a file to link to, or the bytes) in `cache` as `repo_id` at `commit`."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        if isinstance(content, bytes):
            blob = storage / "blobs" / hashlib.sha256(content).hexdigest()
            blob.write_bytes(content)
        else:
            # Large test files (a real GGUF) are hard-linked, not copied, where the file system allows: a blob is
            # a regular file inside the cache, as huggingface_hub writes it (readers refuse links leaving it).
            blob = storage / "blobs" / hashlib.sha256(str(content).encode()).hexdigest()
            if not blob.exists():
                try:
                    os.link(Path(content).resolve(), blob)
                except OSError:
                    shutil.copyfile(content, blob)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (storage / "refs" / ref).write_text(commit)
    return snapshot


def model_files(model_dir: Path) -> dict[str, Path]:
    """Every file of a local model directory, by its name in the repo."""
    return {p.relative_to(model_dir).as_posix(): p for p in sorted(model_dir.rglob("*")) if p.is_file()}
