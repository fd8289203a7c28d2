"""Checks every model file passes before deepinfer reads it: a regular file inside the model directory,
no larger than what its kind may be, read with that bound (never "until EOF").

A model directory is untrusted input. Without these checks a file symlinked to /dev/zero is read
without end, a FIFO blocks the open forever, a sparse 4 GiB file is hashed whole before its size is
compared, and a name taken from a file's metadata (an index's `weight_map`, a manifest's `files`)
can reach `../../etc/passwd` or an absolute path.

Confinement: a file (after following symlinks) must lie inside the model directory. A snapshot of
the Hugging Face cache (`.../models--org--name/snapshots/<revision>/`) keeps its files as symlinks
into `../../blobs/`, so there the confinement root is the repository folder `models--org--name`.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from deepinfer.core.errors import ModelLoadError

# Upper bounds on the size of the small files of a model. Real ones are far below: config.json
# and generation_config.json a few KB, an index or a manifest up to a few MB for the largest
# models, tokenizer.json up to ~35 MB (Gemma's 262k vocabulary).
MAX_JSON_BYTES = 64 << 20
MAX_TOKENIZER_FILE_BYTES = 256 << 20

# The files AutoTokenizer reads from a model directory (and `deepinfer convert` copies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "generation_config.json")
ADDITIONAL_CHAT_TEMPLATES_DIR = "additional_chat_templates"  # transformers reads *.jinja from it


def confinement_root(model_dir: Path) -> Path:
    """The folder every file of `model_dir` must resolve into (see the module docstring)."""
    resolved = Path(os.path.realpath(model_dir))
    absolute = Path(os.path.abspath(model_dir))
    if absolute.parent.name == "snapshots" and absolute.parent.parent.name.startswith("models--"):
        return Path(os.path.realpath(absolute.parent.parent))
    return resolved


def member_path(model_dir: Path, name: Any, where: str) -> Path:
    """`model_dir / name` for a file name read from metadata (`where` says which file and field);
    refuses anything but a plain, normalized relative path: absolute, `..`, `.`, empty parts, backslashes, NUL."""
    if not isinstance(name, str) or not name or len(name) > 4096:
        raise ModelLoadError(f"{where}: file name {name!r} is not a relative path")
    normalized = PurePosixPath(name)
    if normalized.is_absolute() or normalized.as_posix() != name or ".." in normalized.parts or "\\" in name \
            or "\x00" in name:
        raise ModelLoadError(f"{where}: file name {name!r} leaves the model directory")
    return model_dir / name


def checked_file(path: Path, max_bytes: int | None = None, *, root: Path | None = None,
                 what: str = "file") -> int:
    """The size of `path` after checking that it is a regular file inside `root` (default: the
    confinement root of its folder) of at most `max_bytes` bytes. Raises ModelLoadError naming it."""
    root = confinement_root(path.parent) if root is None else root
    try:
        info = os.stat(path)  # follows symlinks: the target is what would be read
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: {what} is missing") from None
    except OSError as err:
        raise ModelLoadError(f"{path}: cannot read the {what}: {err.strerror or err}") from None
    target = Path(os.path.realpath(path))
    if not target.is_relative_to(root):
        raise ModelLoadError(f"{path}: {what} is a link out of the model directory {root} (to {target})")
    if not stat.S_ISREG(info.st_mode):
        raise ModelLoadError(f"{path}: {what} is not a regular file ({_file_kind(info.st_mode)})")
    if max_bytes is not None and info.st_size > max_bytes:
        raise ModelLoadError(f"{path}: {what} has {info.st_size} bytes, more than the {max_bytes} it may have")
    return info.st_size


def read_checked_file(path: Path, max_bytes: int, *, root: Path | None = None, what: str = "file") -> bytes:
    """The bytes of `path`, checked as `checked_file` does; never more than `max_bytes` are read."""
    size = checked_file(path, max_bytes, root=root, what=what)
    try:
        with open(path, "rb") as handle:
            data = handle.read(size + 1)  # one more byte tells a file that grew since the stat
    except OSError as err:
        raise ModelLoadError(f"{path}: cannot read the {what}: {err.strerror or err}") from None
    if len(data) != size:
        raise ModelLoadError(f"{path}: {what} changed size while it was read")
    return data


def read_json_file(path: Path, max_bytes: int = MAX_JSON_BYTES, *, root: Path | None = None) -> dict[str, Any]:
    """A JSON object from `path`, checked and bounded as `read_checked_file` does."""
    data = read_checked_file(path, max_bytes, root=root, what="JSON file")
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise ModelLoadError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: does not hold a JSON object")
    return value


def check_tokenizer_files(model_dir: Path) -> None:
    """Every tokenizer file AutoTokenizer would read from `model_dir` passes `checked_file`."""
    root = confinement_root(model_dir)
    names = [name for name in TOKENIZER_FILES if os.path.lexists(model_dir / name)]
    extra = model_dir / ADDITIONAL_CHAT_TEMPLATES_DIR
    if os.path.lexists(extra):
        if not Path(os.path.realpath(extra)).is_relative_to(root) or not extra.is_dir():
            raise ModelLoadError(f"{extra}: not a folder inside the model directory {root}")
        names += [f"{ADDITIONAL_CHAT_TEMPLATES_DIR}/{p.name}" for p in sorted(extra.iterdir())]
    for name in names:
        checked_file(model_dir / name, MAX_TOKENIZER_FILE_BYTES, root=root, what="tokenizer file")


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a plain file"
