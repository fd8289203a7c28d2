"""Which kind of checkpoint `deepinfer convert` was given: "gptq" | "awq" | "gguf" | "hf"."""

from __future__ import annotations

from pathlib import Path

from deepinfer.core.errors import ConversionError, ModelLoadError
from deepinfer.core.weights.file_checks import checked_file, read_json_file
from deepinfer.core.weights.gguf_header import GGUF_MAGIC
from deepinfer.core.weights.layered import is_layered_checkpoint

SOURCE_KINDS = ("gptq", "awq", "gguf", "hf")


def detect_source(path: Path) -> tuple[str, Path]:
    """(kind, the file or directory to read). A GGUF may be given as the file or a directory holding one."""
    if not path.exists():
        raise ModelLoadError(f"source {path} does not exist")
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
            return "gguf", path
        raise ModelLoadError(f"{path} is neither a .gguf file nor a checkpoint directory")
    if is_layered_checkpoint(path):
        raise ConversionError(f"{path} already is a deepinfer layered checkpoint; load it directly")
    config_path = path / "config.json"
    if not config_path.is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
        raise ModelLoadError(f"no checkpoint in {path}: expected config.json + *.safetensors, or one .gguf file")
    config = read_json_file(config_path)
    quant_config = config.get("quantization_config")
    if isinstance(quant_config, dict):
        method = str(quant_config.get("quant_method", "")).lower()
        if method in ("gptq", "awq"):
            return method, path
        raise ModelLoadError(f"{config_path}: quantization_config has quant_method {method!r}; "
                             f"convert reads gptq and awq checkpoints")
    if (path / "quantize_config.json").is_file():
        return "gptq", path
    if (path / "quant_config.json").is_file():
        return "awq", path
    if _has_packed_tensors(path):
        raise ModelLoadError(f"{path}: tensors are quantized (*.qweight) but there is no quantization config "
                             f"(config.json 'quantization_config', quantize_config.json or quant_config.json)")
    return "hf", path


def _has_gguf_magic(path: Path) -> bool:
    if not path.is_file():  # a FIFO or a device would block or never end
        return False
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _has_packed_tensors(path: Path) -> bool:
    """Whether any safetensors header in `path` names a `.qweight` (read from the header only)."""
    for shard in path.glob("*.safetensors"):
        checked_file(shard, what="weight file")
        try:
            with open(shard, "rb") as handle:
                header_len = int.from_bytes(handle.read(8), "little")
                header = handle.read(min(header_len, 100_000_000))
        except OSError:
            continue
        if b".qweight" in header:
            return True
    return False
