"""ModelSpec adapters read config.json the way HF's config classes do, pitfalls included.

The reference is transformers itself: its config classes (defaults, layer_types), its RoPE init
functions and its norm / embedding modules.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from conftest import tiny_hf_config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from deepinfer.core.errors import ModelLoadError, UnsupportedModelError
from deepinfer.core.models.decoder import DecoderModel
from deepinfer.core.models.layers import RMSNorm, rope_inverse_frequencies
from deepinfer.core.models.spec import ModelSpec

SHAPES = Path(__file__).resolve().parents[1] / "configs" / "shapes"
BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def hf_windows(config) -> tuple:
    """Per-layer window as HF's modeling code decides it."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def raw(model_type: str, architecture: str, **keys) -> dict:
    """A config.json as an older transformers (or a hand-written repo) saves it: only the given keys."""
    return {"architectures": [architecture], "model_type": model_type, **BASE, **keys}


@pytest.mark.parametrize("keys", [{}, {"sliding_window": 4096}, {"sliding_window": 16}, {"sliding_window": None}])
def test_mistral_slides_whenever_sliding_window_is_set(keys):
    config = raw("mistral", "MistralForCausalLM", **keys)
    spec = ModelSpec.from_hf_config(config)
    assert "use_sliding_window" not in config
    assert spec.sliding_windows == hf_windows(transformers.MistralConfig(**config))
    expected = keys.get("sliding_window", 4096)  # HF's class default when the key is absent
    assert spec.sliding_windows == (expected,) * 4


@pytest.mark.parametrize("use_sliding_window", [False, True])
def test_qwen2_slides_only_when_enabled_and_above_max_window_layers(use_sliding_window):
    config = raw("qwen2", "Qwen2ForCausalLM", sliding_window=8, max_window_layers=2,
                 use_sliding_window=use_sliding_window)
    spec = ModelSpec.from_hf_config(config)
    assert spec.sliding_windows == hf_windows(transformers.Qwen2Config(**config))
    assert spec.sliding_windows == ((None, None, 8, 8) if use_sliding_window else (None,) * 4)
    assert spec.qkv_bias and not spec.o_bias


def test_gemma_ties_embeddings_when_config_omits_it():
    config = raw("gemma", "GemmaForCausalLM", head_dim=16, hidden_act="gelu")
    spec = ModelSpec.from_hf_config(config)
    assert transformers.GemmaConfig(**config).tie_word_embeddings
    assert spec.tie_word_embeddings
    assert spec.hidden_act == "gelu_tanh"  # HF rewrites Gemma's legacy "gelu" to the tanh form
    assert spec.norm_weight_offset == 1.0 and spec.embedding_scale == math.sqrt(64)


def test_gemma2_differences():
    config = raw("gemma2", "Gemma2ForCausalLM", head_dim=16, sliding_window=32, query_pre_attn_scalar=24)
    spec = ModelSpec.from_hf_config(config)
    hf = transformers.Gemma2Config(**config)
    assert spec.sliding_windows == hf_windows(hf) == (32, None, 32, None)
    assert spec.attention_scale == 24 ** -0.5
    assert (spec.attn_logit_softcap, spec.final_logit_softcap) == (50.0, 30.0)  # HF defaults
    assert spec.sandwich_norm and spec.tie_word_embeddings and spec.norm_weight_offset == 1.0
    assert spec.hidden_act == "gelu_tanh"


def test_qwen3_has_qk_norm_and_default_head_dim():
    spec = ModelSpec.from_hf_config(raw("qwen3", "Qwen3ForCausalLM"))
    assert spec.qk_norm and spec.head_dim == transformers.Qwen3Config(**BASE).head_dim == 128


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"])
def test_saved_configs_round_trip(family):
    hf = tiny_hf_config(family)
    spec = ModelSpec.from_hf_config(hf.to_dict())
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        hf.num_attention_heads, hf.num_key_value_heads, head_dim)
    assert spec.sliding_windows == hf_windows(hf)
    assert spec.tie_word_embeddings == hf.tie_word_embeddings
    assert spec.eos_token_ids == (2,)


def test_llama3_rope_frequencies_match_transformers():
    hf = tiny_hf_config("llama")
    spec = ModelSpec.from_hf_config(hf.to_dict())
    assert spec.rope_scaling.kind == "llama3"
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    torch.testing.assert_close(rope_inverse_frequencies(spec.head_dim, spec.rope_theta, spec.rope_scaling),
                               expected, atol=0, rtol=0)


def test_linear_rope_in_old_format_matches_transformers():
    config = raw("llama", "LlamaForCausalLM", rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 4.0})
    spec = ModelSpec.from_hf_config(config)
    expected, _ = ROPE_INIT_FUNCTIONS["linear"](transformers.LlamaConfig(**config), "cpu")
    torch.testing.assert_close(rope_inverse_frequencies(spec.head_dim, spec.rope_theta, spec.rope_scaling),
                               expected, atol=0, rtol=0)


def test_unknown_rope_type_is_rejected():
    config = raw("llama", "LlamaForCausalLM", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelSpec.from_hf_config(config)


@pytest.mark.parametrize("config", [
    {"architectures": ["FalconForCausalLM"], "model_type": "falcon"},
    {"model_type": "mamba"},
    {"architectures": ["LlamaForSequenceClassification"], "model_type": "llama"},
])
def test_unknown_architecture_names_itself_and_the_supported_ones(config):
    with pytest.raises(UnsupportedModelError) as err:
        ModelSpec.from_hf_config({**BASE, **config})
    message = str(err.value)
    assert (config.get("architectures") or [config["model_type"]])[0] in message
    assert "LlamaForCausalLM" in message and "Gemma2ForCausalLM" in message


def test_malformed_config_is_a_model_load_error():
    config = raw("llama", "LlamaForCausalLM")
    del config["hidden_size"]
    with pytest.raises(ModelLoadError, match="hidden_size"):
        ModelSpec.from_hf_config(config)


@pytest.mark.parametrize(("shape", "billions"), [("smollm2-135m", 0.1345), ("qwen2.5-3b", 3.086), ("qwen2.5-7b", 7.616)])
def test_shapes_have_the_published_sizes(shape, billions):
    spec = ModelSpec.from_hf_config(json.loads((SHAPES / f"{shape}.json").read_text()))
    model = DecoderModel(spec, dtype=torch.bfloat16, device="meta")
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.001)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("offset", "hf_class"), [(0.0, "LlamaRMSNorm"), (1.0, "GemmaRMSNorm")])
def test_rms_norm_numerics_match_transformers(dtype, offset, hf_class):
    module = getattr(transformers.models.gemma.modeling_gemma if offset else transformers.models.llama.modeling_llama,
                     hf_class)
    hf_norm = module(32, eps=1e-6).to(dtype)
    ours = RMSNorm(32, 1e-6, offset, dtype, "cpu")
    with torch.no_grad():
        hf_norm.weight.normal_(0, 0.5)
        ours.weight.copy_(hf_norm.weight)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0)).to(dtype) * 3
    assert torch.equal(ours(x), hf_norm(x))
