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

# Bounds on every number of a model's config, checked before any of them sizes anything. The maxima
# sit far above every released model of the supported families (Llama 3.1 405B: 126 layers, hidden
# 16384, 128 heads, FFN 53248; Gemma 2: vocabulary 256000; Qwen2.5-1M: 1010000 positions) and far
# below what would exhaust memory by itself (a tuple per layer, a rotary table per position).
MAX_LAYERS = 1024
MAX_HIDDEN_SIZE = 1 << 16
MAX_INTERMEDIATE_SIZE = 1 << 20
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_VOCAB_SIZE = 1 << 22
MAX_POSITION_EMBEDDINGS = 1 << 21
MIN_POSITION_EMBEDDINGS = 2  # a one-token prompt and one generated token
MAX_ROPE_THETA = 1e12
MAX_EOS_TOKEN_IDS = 1024

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
    def from_hf_config(config: dict[str, Any], where: str = "config.json",
                       field_names: dict[str, str] | None = None) -> ModelSpec:
        """Build from the dict of an HF config.json. Every field is checked for type and range first:
        a bad one is a one-line ModelLoadError naming `where` (the file) and the field, under its name
        in `field_names` when given (a GGUF's metadata keys). Unknown architectures raise
        UnsupportedModelError."""
        if not isinstance(config, dict):
            raise ModelLoadError(f"{where}: does not hold a JSON object")
        family = detect_family(config, where)
        cfg = {**_COMMON_DEFAULTS, **_FAMILY_DEFAULTS[family], **config}
        try:
            return _build_spec(family, _Fields(cfg, where, field_names or {}))
        except KeyError as err:
            raise ModelLoadError(f"{where}: the {family} config lacks {err}") from None
        except (TypeError, ValueError) as err:  # a shape of value no check above foresaw
            raise ModelLoadError(f"{where}: malformed {family} config: {type(err).__name__}: {err}") from None


def detect_family(config: dict[str, Any], where: str = "config.json") -> str:
    """Family from `model_type` (and `architectures`, which must be a supported CausalLM class)."""
    supported = ", ".join(sorted(SUPPORTED_MODEL_TYPES.values()))
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    if not isinstance(architectures, list) or not all(isinstance(arch, str) for arch in architectures):
        raise ModelLoadError(f"{where}: architectures is {_shown(architectures)}; it must be a list of class names")
    if model_type is not None and not isinstance(model_type, str):
        raise ModelLoadError(f"{where}: model_type is {_shown(model_type)}; it must be a string")
    if architectures:
        unknown = [arch for arch in architectures if arch not in _ARCHITECTURE_TO_FAMILY]
        if unknown:
            raise UnsupportedModelError(
                f"{where}: unsupported architecture {unknown[0]!r} (model_type {model_type!r}); supported: {supported}")
        family = _ARCHITECTURE_TO_FAMILY[architectures[0]]
        if model_type is not None and model_type != family:
            raise UnsupportedModelError(f"{where}: architecture {architectures[0]!r} does not match model_type {model_type!r}")
        return family
    if model_type in SUPPORTED_MODEL_TYPES:
        return model_type
    raise UnsupportedModelError(f"{where}: unsupported model_type {model_type!r}; supported: {supported}")


_MISSING = object()


class _Fields:
    """Typed, range-checked reads of a config dict; a bad value is a ModelLoadError naming its key."""

    def __init__(self, cfg: dict[str, Any], where: str, field_names: dict[str, str]) -> None:
        self.cfg = cfg
        self.where = where
        self.field_names = field_names

    def __getitem__(self, key: str) -> Any:
        return self.cfg[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.cfg.get(key, default)

    def fail(self, key: str, value: Any, requirement: str) -> ModelLoadError:
        return ModelLoadError(f"{self.where}: {self.field_names.get(key, key)} is {_shown(value)}; "
                              f"it must be {requirement}")

    def int(self, key: str, low: int, high: int, value: Any = _MISSING) -> int:
        """cfg[key] (or `value`, read from elsewhere under that name): an integer in [low, high]."""
        value = self.cfg[key] if value is _MISSING else value
        if not _is_int(value) or not low <= value <= high:
            raise self.fail(key, value, f"an integer in [{low}, {high}]")
        return int(value)

    def float(self, key: str, low: float, high: float, value: Any = _MISSING) -> float:
        """cfg[key] (or `value`): a finite number in (low, high]."""
        value = self.cfg[key] if value is _MISSING else value
        finite = _is_number(value) and (isinstance(value, int) or math.isfinite(value))
        if not finite or not low < value <= high:
            raise self.fail(key, value, f"a finite number in ({low:g}, {high:g}]")
        return float(value)

    def optional_float(self, key: str, low: float, high: float) -> float | None:
        value = self.cfg.get(key)
        return None if value is None else self.float(key, low, high, value)

    def bool(self, key: str) -> bool:
        value = self.cfg[key]
        if not isinstance(value, bool):
            raise self.fail(key, value, "true or false")
        return value

    def token_id(self, key: str, value: Any, vocab_size: int) -> int:
        if not _is_int(value) or not 0 <= value < vocab_size:
            raise self.fail(key, value, f"a token id in [0, {vocab_size})")
        return int(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _build_spec(family: str, cfg: _Fields) -> ModelSpec:
    num_heads = cfg.int("num_attention_heads", 1, MAX_HEADS)
    num_kv_heads = num_heads if cfg["num_key_value_heads"] is None else cfg.int("num_key_value_heads", 1, num_heads)
    hidden_size = cfg.int("hidden_size", 1, MAX_HIDDEN_SIZE)
    if cfg["head_dim"] is None:
        head_dim = cfg.int("head_dim (hidden_size // num_attention_heads)", 2, MAX_HEAD_DIM, hidden_size // num_heads)
    else:
        head_dim = cfg.int("head_dim", 2, MAX_HEAD_DIM)
    num_layers = cfg.int("num_hidden_layers", 1, MAX_LAYERS)
    vocab_size = cfg.int("vocab_size", 1, MAX_VOCAB_SIZE)
    intermediate_size = cfg.int("intermediate_size", 1, MAX_INTERMEDIATE_SIZE)
    max_positions = cfg.int("max_position_embeddings", MIN_POSITION_EMBEDDINGS, MAX_POSITION_EMBEDDINGS)
    if num_heads % num_kv_heads != 0:
        raise cfg.fail("num_key_value_heads", num_kv_heads, f"a divisor of num_attention_heads {num_heads}")
    if head_dim % 2 != 0:
        raise cfg.fail("head_dim", head_dim, "even (RoPE rotates pairs)")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"{cfg.where}: partial_rotary_factor {_shown(cfg['partial_rotary_factor'])} "
                                    f"is not supported")

    is_gemma = family in ("gemma", "gemma2")
    act_key = "hidden_activation" if family == "gemma2" else "hidden_act"
    act_name = cfg[act_key]
    if family == "gemma" and act_name == "gelu":
        act_name = "gelu_pytorch_tanh"  # HF GemmaConfig rewrites the legacy "gelu" to the tanh form
    if not isinstance(act_name, str) or act_name not in _ACTIVATIONS:
        raise UnsupportedModelError(f"{cfg.where}: unsupported {act_key} {_shown(act_name)}; "
                                    f"supported: {', '.join(_ACTIVATIONS)}")

    attention_bias = cfg.bool("attention_bias")
    rope_theta, rope_scaling = _read_rope(cfg, head_dim, max_positions)
    eos = cfg.get("eos_token_id")
    eos_list = eos if isinstance(eos, list) else [eos]
    if len(eos_list) > MAX_EOS_TOKEN_IDS:
        raise cfg.fail("eos_token_id", eos, f"at most {MAX_EOS_TOKEN_IDS} token ids")
    eos_ids = tuple(cfg.token_id("eos_token_id", e, vocab_size) for e in eos_list if e is not None)
    bos = cfg.get("bos_token_id")
    bos_id = None if bos is None else cfg.token_id("bos_token_id", bos, vocab_size)
    if family == "gemma2":
        attention_scale = cfg.float("query_pre_attn_scalar", 0.0, 1e9) ** -0.5
    else:
        attention_scale = head_dim**-0.5
    torch_dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    if torch_dtype is not None and not isinstance(torch_dtype, str):
        raise cfg.fail("torch_dtype", torch_dtype, "a dtype name")

    return ModelSpec(
        family=family,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.float("rms_norm_eps", 0.0, 1.0),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_positions,
        tie_word_embeddings=cfg.bool("tie_word_embeddings"),
        qkv_bias=True if family == "qwen2" else attention_bias,
        o_bias=False if family == "qwen2" else attention_bias,
        mlp_bias=cfg.bool("mlp_bias") if family == "llama" else False,
        hidden_act=_ACTIVATIONS[act_name],
        norm_weight_offset=1.0 if is_gemma else 0.0,
        embedding_scale=math.sqrt(hidden_size) if is_gemma else None,
        sandwich_norm=family == "gemma2",
        attn_logit_softcap=cfg.optional_float("attn_logit_softcapping", 0.0, 1e6) if family == "gemma2" else None,
        final_logit_softcap=cfg.optional_float("final_logit_softcapping", 0.0, 1e6) if family == "gemma2" else None,
        attention_scale=attention_scale,
        sliding_windows=_sliding_windows(family, cfg, num_layers),
        qk_norm=family == "qwen3",
        bos_token_id=bos_id,
        eos_token_ids=eos_ids,
        torch_dtype=torch_dtype,
    )


def _sliding_windows(family: str, cfg: _Fields, num_layers: int) -> tuple[int | None, ...]:
    """Window per layer, exactly as HF's config classes derive `layer_types`."""
    window = cfg.get("sliding_window")
    if window is not None:
        window = cfg.int("sliding_window", 1, 1 << 31)
    if family == "mistral":
        return (window,) * num_layers  # no use_sliding_window switch: set means used
    if family in ("qwen2", "qwen3"):
        if not cfg.bool("use_sliding_window") or window is None:
            return (None,) * num_layers
        max_window_layers = cfg.int("max_window_layers", 0, 1 << 31)
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if i >= max_window_layers else "full_attention" for i in range(num_layers)]
    elif family == "gemma2":
        if window is None:
            return (None,) * num_layers
        layer_types = cfg.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    else:
        return (None,) * num_layers
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise cfg.fail("layer_types", layer_types, f"a list of {num_layers} entries, one per layer")
    unknown = next((kind for kind in layer_types if kind not in ("sliding_attention", "full_attention")), None)
    if unknown is not None:
        raise cfg.fail("layer_types", unknown, "'sliding_attention' or 'full_attention'")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def _read_rope(cfg: _Fields, head_dim: int, max_positions: int) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from transformers 5 `rope_parameters` or the older `rope_theta` + `rope_scaling`."""
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    params = cfg.get(key) or {}
    if not isinstance(params, dict):
        raise cfg.fail(key, params, "an object")
    theta_key = f"{key}.rope_theta" if "rope_theta" in params else "rope_theta"
    theta = cfg.float(theta_key, 0.0, MAX_ROPE_THETA, params.get("rope_theta", cfg["rope_theta"]))
    kind = params.get("rope_type", params.get("type", "default"))

    def number(name: str, low: float = 0.0, high: float = 1e6) -> float:
        if name not in params:
            raise KeyError(f"{key}.{name}")
        return cfg.float(f"{key}.{name}", low, high, params[name])

    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling(kind="linear", factor=number("factor"))
    if kind == "llama3":
        low, high = number("low_freq_factor"), number("high_freq_factor")
        if not low < high:  # the smoothing divides by high - low
            raise cfg.fail(f"{key}.high_freq_factor", high, f"greater than low_freq_factor {low:g}")
        original = params.get("original_max_position_embeddings", max_positions)
        return theta, RopeScaling(
            kind="llama3",
            factor=number("factor"),
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=cfg.int(f"{key}.original_max_position_embeddings", 1,
                                                     MAX_POSITION_EMBEDDINGS, original),
        )
    if kind == "freq_factors":  # not an HF type: only the GGUF reader produces it
        factors = params.get("freq_factors")
        if not isinstance(factors, (list, tuple)) or len(factors) != head_dim // 2:
            raise cfg.fail(f"{key}.freq_factors", factors, f"{head_dim // 2} factors, one per rotary frequency")
        return theta, RopeScaling(kind="freq_factors", freq_factors=tuple(
            cfg.float(f"{key}.freq_factors", 0.0, 1e6, f) for f in factors))
    raise UnsupportedModelError(f"{cfg.where}: unsupported rope scaling type {_shown(kind)}; "
                                f"supported: default, linear, llama3")

