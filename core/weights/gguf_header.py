"""A bounded walk over a GGUF file's header, before gguf-py parses it.

gguf-py trusts the counts and lengths it reads: an array that claims 2**63 strings loops forever, a
tensor offset near 2**64 wraps in its uint64 arithmetic, and tensors may overlap or share bytes.
`scan_gguf_header` walks the same layout (GGUF v2/v3: magic, version, tensor count, KV count, the
KVs, the tensor infos, then aligned tensor data) checking every count and length against the bytes
left in the file, so the walk takes time linear in the header and memory independent of it:

- counts of KVs and tensors, lengths of strings and arrays: each fits the bytes that remain (and
  a sane maximum);
- tensor infos: 1 to 4 dimensions of at least 1, a known ggml type whose block divides the row,
  an offset aligned to `general.alignment` (a power of two), the byte range inside the file
  computed without overflow, and no two ranges overlapping;
- names: valid UTF-8, unique.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from deepinfer.core.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_TENSORS = 1 << 16  # a 1024-layer model has ~15k
MAX_KVS = 1 << 16
MAX_ARRAY_ITEMS = 1 << 22  # the longest arrays are the vocabulary's (tokens, scores, merges)
MAX_NAME_BYTES = 1 << 10  # ggml allows 63
MAX_ARRAY_DEPTH = 3

_STRING, _ARRAY = 8, 9
# GGUF value type -> bytes of one scalar (uint8, int8, uint16, int16, uint32, int32, float32, bool,
# uint64, int64, float64).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclass(frozen=True)
class TensorRange:
    name: str
    type_id: int
    shape: tuple[int, ...]  # GGUF order: innermost dimension first
    start: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFLayout:
    version: int
    alignment: int
    data_offset: int  # where tensor data begins
    tensors: tuple[TensorRange, ...]


class _Header:
    """Reads little- or big-endian values from the mapped file, refusing to run past its end."""

    def __init__(self, buffer: mmap.mmap, path: Path, order: str) -> None:
        self.buffer = buffer
        self.size = len(buffer)
        self.path = path
        self.pos = 0
        self.u32 = struct.Struct(order + "I")
        self.u64 = struct.Struct(order + "Q")

    def fail(self, message: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: GGUF header is damaged: {message} (at byte {self.pos})")

    def need(self, count: int, what: str) -> None:
        if count > self.size - self.pos:
            raise self.fail(f"{what} needs {count} bytes, the file has {self.size - self.pos} left")

    def uint32(self, what: str) -> int:
        self.need(4, what)
        (value,) = self.u32.unpack_from(self.buffer, self.pos)
        self.pos += 4
        return value

    def uint64(self, what: str) -> int:
        self.need(8, what)
        (value,) = self.u64.unpack_from(self.buffer, self.pos)
        self.pos += 8
        return value

    def string(self, what: str, max_bytes: int | None = None) -> str:
        length = self.uint64(f"length of {what}")
        if max_bytes is not None and length > max_bytes:
            raise self.fail(f"{what} is {length} bytes long, more than {max_bytes}")
        self.need(length, what)
        raw = bytes(self.buffer[self.pos:self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def skip_value(self, type_id: int, key: str, depth: int = 0) -> None:
        """Step over one value of GGUF type `type_id`, checking its lengths."""
        if type_id in _SCALAR_BYTES:
            self.need(_SCALAR_BYTES[type_id], f"value of {key}")
            self.pos += _SCALAR_BYTES[type_id]
        elif type_id == _STRING:
            self.skip_string(key)
        elif type_id == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise self.fail(f"{key} nests arrays more than {MAX_ARRAY_DEPTH} deep")
            item_type = self.uint32(f"item type of {key}")
            count = self.uint64(f"length of {key}")
            if count > MAX_ARRAY_ITEMS:
                raise self.fail(f"{key} claims {count} items, more than {MAX_ARRAY_ITEMS}")
            if item_type in _SCALAR_BYTES:
                self.need(count * _SCALAR_BYTES[item_type], f"{count} items of {key}")
                self.pos += count * _SCALAR_BYTES[item_type]
            elif item_type == _STRING:
                self.need(count * 8, f"{count} strings of {key}")  # each has at least its length
                for _ in range(count):
                    self.skip_string(key)
            elif item_type == _ARRAY:
                self.need(count * 12, f"{count} arrays of {key}")
                for _ in range(count):
                    self.skip_value(_ARRAY, key, depth + 1)
            else:
                raise self.fail(f"{key} has items of unknown type {item_type}")
        else:
            raise self.fail(f"{key} has unknown value type {type_id}")

    def skip_string(self, key: str) -> None:
        length = self.uint64(f"string length in {key}")
        self.need(length, f"string in {key}")
        self.pos += length


def scan_gguf_header(path: Path) -> GGUFLayout:
    """The checked layout of the GGUF at `path` (a regular file, checked by the caller)."""
    import gguf

    try:
        with open(path, "rb") as handle:
            if handle.read(4) != GGUF_MAGIC:
                raise ModelLoadError(f"{path}: not a GGUF file (magic is not {GGUF_MAGIC!r})")
            buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as err:
        raise ModelLoadError(f"{path}: cannot read the GGUF file: {err.strerror or err}") from None
    with buffer:
        if len(buffer) < 24:
            raise ModelLoadError(f"{path}: GGUF file is truncated ({len(buffer)} bytes, the header alone needs 24)")
        (version,) = struct.unpack_from("<I", buffer, 4)
        order = ">" if version & 0xFFFF == 0 else "<"  # a byte-swapped (big-endian) file, as gguf-py reads it
        header = _Header(buffer, path, order)
        header.pos = 4
        version = header.uint32("version")
        if version not in SUPPORTED_VERSIONS:
            raise header.fail(f"version {version} is not supported (GGUF {SUPPORTED_VERSIONS[0]} or "
                              f"{SUPPORTED_VERSIONS[-1]})")
        tensor_count = header.uint64("tensor count")
        kv_count = header.uint64("KV count")
        if tensor_count > MAX_TENSORS:
            raise header.fail(f"tensor count {tensor_count} exceeds {MAX_TENSORS}")
        if kv_count > MAX_KVS:
            raise header.fail(f"KV count {kv_count} exceeds {MAX_KVS}")
        alignment = DEFAULT_ALIGNMENT
        keys: set[str] = set()
        for _ in range(kv_count):
            key = header.string("a metadata key", MAX_NAME_BYTES)
            if key in keys:
                raise header.fail(f"metadata key {key!r} appears twice")
            keys.add(key)
            type_id = header.uint32(f"type of {key}")
            if key == "general.alignment":
                if type_id != 4:
                    raise header.fail("general.alignment must be a uint32")
                alignment = header.uint32(key)
                if alignment == 0 or alignment & (alignment - 1):
                    raise header.fail(f"general.alignment {alignment} is not a power of two")
            else:
                header.skip_value(type_id, key)
        type_sizes = {int(kind): sizes for kind, sizes in gguf.GGML_QUANT_SIZES.items()}
        infos = [_tensor_info(header, type_sizes) for _ in range(tensor_count)]
        data_offset = -(-header.pos // alignment) * alignment
        tensors = []
        names: set[str] = set()
        for name, type_id, shape, offset, nbytes in infos:
            if name in names:
                raise ModelLoadError(f"{path}: tensor {name!r} is declared twice")
            names.add(name)
            if offset % alignment:
                raise ModelLoadError(f"{path}: tensor {name!r} offset {offset} is not a multiple of the "
                                     f"alignment {alignment}")
            start = data_offset + offset
            if start + nbytes > header.size:
                raise ModelLoadError(f"{path}: GGUF file is truncated: tensor {name!r} needs bytes up to "
                                     f"{start + nbytes}, the file has {header.size}")
            tensors.append(TensorRange(name, type_id, shape, start, nbytes))
        previous = None
        for tensor in sorted(tensors, key=lambda t: t.start):
            if previous is not None and tensor.start < previous.start + previous.nbytes:
                raise ModelLoadError(f"{path}: tensors {previous.name!r} and {tensor.name!r} overlap "
                                     f"(bytes {tensor.start} to {previous.start + previous.nbytes})")
            previous = tensor
        return GGUFLayout(version, alignment, data_offset, tuple(tensors))


def _tensor_info(header: _Header, type_sizes: dict[int, tuple[int, int]]) -> tuple[str, int, tuple[int, ...], int, int]:
    """(name, ggml type, shape, offset relative to the data, bytes) of the next tensor info.
    type_sizes: ggml type -> (weights per block, bytes per block)."""
    name = header.string("a tensor name", MAX_NAME_BYTES)
    n_dims = header.uint32(f"dimension count of {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise header.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS})")
    shape = tuple(header.uint64(f"dimension of {name!r}") for _ in range(n_dims))
    type_id = header.uint32(f"type of {name!r}")
    offset = header.uint64(f"offset of {name!r}")
    sizes = type_sizes.get(type_id)
    if sizes is None:
        raise header.fail(f"tensor {name!r} has unknown ggml type {type_id}")
    block_size, block_bytes = sizes
    if any(dim < 1 for dim in shape):
        raise header.fail(f"tensor {name!r} has an empty dimension {shape}")
    if shape[0] % block_size:
        raise header.fail(f"tensor {name!r} rows of {shape[0]} are not whole blocks of {block_size}")
    numel = 1
    for dim in shape:
        numel *= dim  # Python ints: no overflow; the range check against the file bounds it
    return name, type_id, shape, offset, numel // block_size * block_bytes
