"""ModelSpec: one normalized description of a decoder-only model, whatever file it came from.

Each supported family has an adapter that reads an HF `config.json` dict (GGUF metadata is first
turned into such a dict by core/weights/gguf_reader.py). The adapters encode what HF's config
classes do *implicitly*, because a saved config.json often omits a field and HF fills in the
class default:

- Mistral uses `sliding_window` on every layer whenever it is set (there is no
  `use_sliding_window` switch; HF's default when the key is absent is 4096).
- Qwen2/Qwen3 slide only when `use_sliding_window` is true, and then only on layers
  `i >= max_window_layers` (or where `layer_types` says "sliding_attention").
- Gemma/Gemma 2 tie lm_head to the embedding when `tie_word_embeddings` is absent.
- Gemma 2: `1 + weight` RMSNorm, sqrt(hidden) embedding scale, sandwich norms, attention and
  final logit softcaps, sliding window on even layers, `query_pre_attn_scalar ** -0.5` scaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from deepinfer.core.errors import ModelLoadError, UnsupportedModelError

# model_type -> (family, HF architecture class name)
SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}
_ARCHITECTURE_TO_FAMILY = {arch: family for family, arch in SUPPORTED_MODEL_TYPES.items()}

# Defaults of HF's config classes (transformers 5.x) for keys a saved config.json may omit.
_COMMON_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "head_dim": None,
    "num_key_value_heads": None,
}
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": 4096, "max_position_embeddings": 4096 * 32},
    "qwen2": {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
              "max_position_embeddings": 32768},
    "qwen3": {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
              "max_position_embeddings": 32768, "head_dim": 128},
    "gemma": {"head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True,
              "max_position_embeddings": 8192},
    "gemma2": {"head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
               "max_position_embeddings": 8192, "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
}

# HF activation names -> the two gates the decoder implements.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                "gelu": "gelu"}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind`: "linear" (inv_freq / factor), "llama3" (Llama 3.1 smoothing), or
    "freq_factors" (inv_freq / freq_factors[i]: how llama.cpp's GGUF stores Llama 3 scaling, `rope_freqs`)."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] = ()


@dataclass(frozen=True)
class ModelSpec:
    family: str  # llama | mistral | qwen2 | qwen3 | gemma | gemma2
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections (Qwen2 always; Llama/Gemma when attention_bias)
    o_bias: bool  # bias on o_proj (Llama/Gemma attention_bias; never for Qwen2)
    mlp_bias: bool
    hidden_act: str  # "silu" | "gelu_tanh" | "gelu": gate activation of the gated MLP
    norm_weight_offset: float  # 1.0 for Gemma's `x * (1 + weight)` RMSNorm, else 0.0
    embedding_scale: float | None  # Gemma: sqrt(hidden_size), applied in model dtype
    sandwich_norm: bool  # Gemma 2: post-attention and pre/post-feedforward norms
    attn_logit_softcap: float | None
    final_logit_softcap: float | None
    attention_scale: float  # multiplies q.k
    sliding_windows: tuple[int | None, ...]  # per layer; key visible iff key_pos > query_pos - window
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None = None  # the checkpoint's own dtype, if it says

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def has_sliding_window(self) -> bool:
        return any(window is not None for window in self.sliding_windows)

    @staticmethod
    def from_hf_config(config: dict[str, Any]) -> ModelSpec:
        """Build from the dict of an HF config.json. Unknown architectures raise UnsupportedModelError."""
        family = detect_family(config)
        cfg = {**_COMMON_DEFAULTS, **_FAMILY_DEFAULTS[family], **config}
        try:
            return _build_spec(family, cfg)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
            raise ModelLoadError(f"config of {family} model is malformed: {type(err).__name__}: {err}") from None


def detect_family(config: dict[str, Any]) -> str:
    """Family from `model_type` (and `architectures`, which must be a supported CausalLM class)."""
    supported = ", ".join(sorted(SUPPORTED_MODEL_TYPES.values()))
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    if architectures:
        unknown = [arch for arch in architectures if arch not in _ARCHITECTURE_TO_FAMILY]
        if unknown:
            raise UnsupportedModelError(
                f"unsupported architecture {unknown[0]!r} (model_type {model_type!r}); supported: {supported}")
        family = _ARCHITECTURE_TO_FAMILY[architectures[0]]
        if model_type is not None and model_type != family:
            raise UnsupportedModelError(f"architecture {architectures[0]!r} does not match model_type {model_type!r}")
        return family
    if model_type in SUPPORTED_MODEL_TYPES:
        return model_type
    raise UnsupportedModelError(f"unsupported model_type {model_type!r}; supported: {supported}")


def _build_spec(family: str, cfg: dict[str, Any]) -> ModelSpec:
    num_heads = int(cfg["num_attention_heads"])
    num_kv_heads = int(cfg["num_key_value_heads"] or num_heads)
    hidden_size = int(cfg["hidden_size"])
    head_dim = int(cfg["head_dim"] or hidden_size // num_heads)
    num_layers = int(cfg["num_hidden_layers"])
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim {head_dim} must be even for RoPE")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor {cfg['partial_rotary_factor']} is not supported")

    is_gemma = family in ("gemma", "gemma2")
    act_name = cfg["hidden_activation"] if family == "gemma2" else cfg["hidden_act"]
    if family == "gemma" and act_name == "gelu":
        act_name = "gelu_pytorch_tanh"  # HF GemmaConfig rewrites the legacy "gelu" to the tanh form
    if act_name not in _ACTIVATIONS:
        raise UnsupportedModelError(f"unsupported activation {act_name!r}; supported: {', '.join(_ACTIVATIONS)}")

    attention_bias = bool(cfg["attention_bias"])
    rope_theta, rope_scaling = _read_rope(cfg)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
    if family == "gemma2":
        attention_scale = float(cfg["query_pre_attn_scalar"]) ** -0.5
    else:
        attention_scale = head_dim**-0.5

    return ModelSpec(
        family=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
        qkv_bias=True if family == "qwen2" else attention_bias,
        o_bias=False if family == "qwen2" else attention_bias,
        mlp_bias=bool(cfg["mlp_bias"]) if family == "llama" else False,
        hidden_act=_ACTIVATIONS[act_name],
        norm_weight_offset=1.0 if is_gemma else 0.0,
        embedding_scale=math.sqrt(hidden_size) if is_gemma else None,
        sandwich_norm=family == "gemma2",
        attn_logit_softcap=_optional_float(cfg.get("attn_logit_softcapping")) if family == "gemma2" else None,
        final_logit_softcap=_optional_float(cfg.get("final_logit_softcapping")) if family == "gemma2" else None,
        attention_scale=attention_scale,
        sliding_windows=_sliding_windows(family, cfg, num_layers),
        qk_norm=family == "qwen3",
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
    )


def _sliding_windows(family: str, cfg: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Window per layer, exactly as HF's config classes derive `layer_types`."""
    window = cfg.get("sliding_window")
    if family == "mistral":
        return (window,) * num_layers  # no use_sliding_window switch: set means used
    if family in ("qwen2", "qwen3"):
        if not cfg["use_sliding_window"] or window is None:
            return (None,) * num_layers
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if i >= int(cfg["max_window_layers"]) else "full_attention" for i in range(num_layers)]
    elif family == "gemma2":
        if window is None:
            return (None,) * num_layers
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    else:
        return (None,) * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    return tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)


def _read_rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from transformers 5 `rope_parameters` or the older `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg["rope_theta"]))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", cfg["max_position_embeddings"])),
        )
    if kind == "freq_factors":  # not an HF type: only the GGUF reader produces it
        return theta, RopeScaling(kind="freq_factors", freq_factors=tuple(float(f) for f in params["freq_factors"]))
    raise UnsupportedModelError(f"unsupported rope scaling type {kind!r}; supported: default, linear, llama3")


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
