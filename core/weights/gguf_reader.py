"""Read a GGUF file (llama.cpp's format) with gguf-py: metadata -> HF-style config, tensors -> HF names.

This is the reference path: every tensor is dequantized to float32 with `gguf.quants.dequantize`
and loaded into the plain decoder. Two conventions of llama.cpp's converter are undone here,
as transformers' GGUF loader does (`modeling_gguf_pytorch_utils.py`):

- llama-arch Q and K rows are permuted (interleaved rotary pairs); `_unpermute_rows` restores
  HF's rotate-half order.
- Gemma / Gemma 2 RMSNorm weights are stored as `1 + weight`; we subtract the 1 back because
  the decoder adds it (norm_weight_offset).
- Llama 3 RoPE scaling is stored as a `rope_freqs.weight` tensor of per-frequency divisors; it
  becomes ModelSpec.rope_scaling ("freq_factors"), not a weight.

The file is untrusted: before gguf-py parses it, core/weights/gguf_header.py walks its header with
every count, length and tensor range checked against the file (a truncated download, an array that
claims 2**63 items, overlapping tensors are one-line ModelLoadErrors); the metadata then goes
through ModelSpec's bounds under its GGUF key names, and the tensors the header declares must be
exactly those of the model the metadata describes, before anything is allocated.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepinfer.core.errors import ModelLoadError, UnsupportedModelError
from deepinfer.core.models.spec import MAX_HEAD_DIM, SUPPORTED_MODEL_TYPES, ModelSpec
from deepinfer.core.weights.file_checks import checked_file
from deepinfer.core.weights.gguf_header import scan_gguf_header
from deepinfer.core.weights.tensor_checks import check_tensors_match_spec

ROPE_FREQS = "rope_freqs.weight"

# general.architecture -> HF model_type
_ARCH_TO_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma", "gemma2": "gemma2"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}
# The norm after attention is named by role, which differs between plain and sandwich layers.
_PLAIN_NORMS = {"ffn_norm": "post_attention_layernorm"}
_SANDWICH_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                   "post_ffw_norm": "post_feedforward_layernorm"}


def layer_norm_names(spec: ModelSpec) -> dict[str, str]:
    """GGUF -> HF names of a layer's norms, which depend on whether the layers are sandwiched."""
    return _SANDWICH_NORMS if spec.sandwich_norm else _PLAIN_NORMS


_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)")


def open_gguf(path: Path) -> Any:
    """A `gguf.GGUFReader` over `path` (a regular file), its header checked first (gguf_header.py)."""
    import gguf

    checked_file(path, what="GGUF file")
    layout = scan_gguf_header(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as err:  # noqa: BLE001 - gguf-py raises ValueError, IndexError... on a damaged header
        raise ModelLoadError(f"{path}: GGUF file is damaged ({type(err).__name__}: {err})") from None
    # gguf-py must see the ranges that were checked (its offsets are uint64 arithmetic).
    ranges = {tensor.name: (tensor.start, tensor.nbytes) for tensor in layout.tensors}
    for tensor in reader.tensors:
        if ranges.get(tensor.name) != (int(tensor.data_offset), int(tensor.n_bytes)) \
                or tensor.data.nbytes != int(tensor.n_bytes):
            raise ModelLoadError(f"{path}: GGUF tensor {tensor.name!r} is not where its header says")
    return reader


def read_field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_metadata_to_hf_config(reader: Any) -> dict[str, Any]:
    """The HF config.json the GGUF's metadata describes (what transformers' GGUF loader builds),
    checked: every number within ModelSpec's bounds (errors name the GGUF key), and the tensors the
    header declares exactly those of the model it describes (names and shapes)."""
    where = str(reader.data.filename)
    arch = read_field(reader, "general.architecture")
    model_type = _ARCH_TO_MODEL_TYPE.get(arch) if isinstance(arch, str) else None
    if model_type is None:
        raise UnsupportedModelError(
            f"{where}: unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(_ARCH_TO_MODEL_TYPE))}")
    names = {tensor.name for tensor in reader.tensors}

    def meta(key: str, default: Any = None) -> Any:
        return read_field(reader, f"{arch}.{key}", default)

    num_heads = meta("attention.head_count")
    hidden_size = meta("embedding_length")
    num_layers = meta("block_count")
    missing = [key for key, value in (("attention.head_count", num_heads), ("embedding_length", hidden_size),
                                      ("block_count", num_layers)) if value is None]
    if missing:
        raise ModelLoadError(f"{where}: GGUF metadata lacks {', '.join(f'{arch}.{key}' for key in missing)}")
    head_dim = meta("attention.key_length") or meta("rope.dimension_count")  # None: hidden / heads
    token_field = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = meta("vocab_size") or (len(token_field.data) if token_field is not None else 0) \
        or _embedding_rows(reader)
    eos_ids = [read_field(reader, f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id")]

    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [SUPPORTED_MODEL_TYPES[model_type]],
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta("attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "max_position_embeddings": meta("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": read_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": [e for e in dict.fromkeys(eos_ids) if e is not None],
    }
    scaling_type = meta("rope.scaling.type", "none")
    if ROPE_FREQS in names:  # Llama 3.x: HF's llama3 scaling, baked into one factor per frequency
        config["rope_scaling"] = {"rope_type": "freq_factors", "freq_factors": _rope_freq_factors(reader, where)}
    elif scaling_type == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": meta("rope.scaling.factor")}
    elif scaling_type != "none":
        raise UnsupportedModelError(f"{where}: unsupported GGUF rope scaling type {scaling_type!r}; "
                                    f"supported: none, linear")
    if model_type == "gemma2":
        config["sliding_window"] = meta("attention.sliding_window")
        config["attn_logit_softcapping"] = meta("attn_logit_softcapping", 50.0)
        config["final_logit_softcapping"] = meta("final_logit_softcapping", 30.0)
        # llama.cpp's rule: Gemma 2 27B (46 layers) scales by hidden/heads, the others by head_dim.
        per_head = hidden_size // num_heads if _positive_ints(hidden_size, num_heads) else None
        config["query_pre_attn_scalar"] = per_head if num_layers == 46 or head_dim is None else head_dim
    spec = ModelSpec.from_hf_config(config, where, _gguf_field_names(arch))
    norm_names = layer_norm_names(spec)
    shapes = {gguf_to_hf_name(t.name, norm_names): tuple(int(d) for d in reversed(t.shape))
              for t in reader.tensors if t.name != ROPE_FREQS}
    check_tensors_match_spec(spec, shapes, where, layers_field=f"{arch}.block_count")
    return config


def gguf_spec(reader: Any) -> ModelSpec:
    """The ModelSpec of an open `gguf.GGUFReader` (metadata -> HF-style config -> from_hf_config)."""
    return ModelSpec.from_hf_config(gguf_metadata_to_hf_config(reader))


def _gguf_field_names(arch: str) -> dict[str, str]:
    """HF config key -> the GGUF metadata key it was read from, for error messages."""
    return {
        "vocab_size": f"{arch}.vocab_size (or the token list's length)",
        "hidden_size": f"{arch}.embedding_length",
        "intermediate_size": f"{arch}.feed_forward_length",
        "num_hidden_layers": f"{arch}.block_count",
        "num_attention_heads": f"{arch}.attention.head_count",
        "num_key_value_heads": f"{arch}.attention.head_count_kv",
        "head_dim": f"{arch}.attention.key_length",
        "rms_norm_eps": f"{arch}.attention.layer_norm_rms_epsilon",
        "rope_theta": f"{arch}.rope.freq_base",
        "max_position_embeddings": f"{arch}.context_length",
        "rope_scaling.factor": f"{arch}.rope.scaling.factor",
        "rope_scaling.freq_factors": ROPE_FREQS,
        "sliding_window": f"{arch}.attention.sliding_window",
        "attn_logit_softcapping": f"{arch}.attn_logit_softcapping",
        "final_logit_softcapping": f"{arch}.final_logit_softcapping",
        "query_pre_attn_scalar": f"{arch}.attention.key_length",
        "bos_token_id": "tokenizer.ggml.bos_token_id",
        "eos_token_id": "tokenizer.ggml.eos_token_id / eot_token_id",
    }


def _positive_ints(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)


def iter_gguf_weights(reader: Any, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor, dequantized and un-permuted."""
    from gguf.quants import dequantize

    norm_names = layer_norm_names(spec)
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            continue  # read into ModelSpec.rope_scaling
        hf_name = gguf_to_hf_name(tensor.name, norm_names)
        try:
            values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        except NotImplementedError as err:
            raise UnsupportedModelError(f"GGUF tensor {tensor.name!r}: {err}") from None
        values = values.reshape([int(d) for d in reversed(tensor.shape)])  # GGUF shapes are innermost-first
        if spec.family in ("llama", "mistral") and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = spec.num_heads if ".attn_q." in tensor.name else spec.num_kv_heads
            values = _unpermute_rows(values, heads)
        if spec.norm_weight_offset and hf_name.endswith("norm.weight"):
            values = values - spec.norm_weight_offset
        if not values.flags.writeable:  # F32 tensors are views of the read-only memory map
            values = values.copy()
        yield hf_name, torch.from_numpy(np.ascontiguousarray(values))


def gguf_to_hf_name(name: str, norm_names: dict[str, str] = _PLAIN_NORMS) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_TENSOR.fullmatch(name)
    if match:
        layer, part, kind = match.groups()
        hf_part = _LAYER_NAMES.get(part) or norm_names.get(part)
        if hf_part is not None:
            return f"model.layers.{layer}.{hf_part}.{kind}"
    raise UnsupportedModelError(f"GGUF tensor {name!r} has no counterpart in the supported architectures")


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: per head, rows (pair, 2) -> (2, pair). weight: [heads * head_dim, ...]."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(2, 1).reshape(weight.shape)


def _rope_freq_factors(reader: Any, where: str) -> list[float]:
    from gguf.quants import dequantize

    tensor = next(t for t in reader.tensors if t.name == ROPE_FREQS)
    if int(tensor.n_elements) > MAX_HEAD_DIM // 2:  # one factor per rotary frequency: head_dim / 2
        raise ModelLoadError(f"{where}: {ROPE_FREQS} has {int(tensor.n_elements)} factors, more than a head "
                             f"of at most {MAX_HEAD_DIM} dimensions rotates")
    try:
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(-1)
    except NotImplementedError as err:
        raise UnsupportedModelError(f"{where}: GGUF tensor {ROPE_FREQS!r}: {err}") from None
    return [float(f) for f in values]


def _embedding_rows(reader: Any) -> int:
    for tensor in reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])
    raise ModelLoadError(f"{reader.data.filename}: GGUF file has no token_embd.weight")
