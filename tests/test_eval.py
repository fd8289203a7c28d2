"""`deepinfer eval`: perplexity over llama-perplexity's windows equal to HF transformers' on the same windows,
KL-divergence of a model against itself 0, and on SmolLM2 round-to-nearest W3A16 costing more than W4A16."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from deepinfer.core.config import EngineConfig
from deepinfer.core.eval.quality import evaluate
from deepinfer.core.eval.windows import Window, plan_windows
from deepinfer.core.models.loader import read_model
from deepinfer.core.quant.quantize_model import quantize_projections

TEXT = ("The capital of France is Paris. It lies on the Seine, in the north of the country, and has been its "
        "largest city for centuries. Paris is known for its museums, its cafes and its long avenues; the Louvre "
        "holds the Mona Lisa, and the Eiffel Tower was built for a world fair in 1889. Every year millions of "
        "visitors walk along the river, climb the hill of Montmartre and eat bread that was baked the same "
        "morning. The city is divided into twenty districts that spiral out from the centre like a snail's "
        "shell, and each has a character of its own. ") * 2


def hf_perplexity(hf_model, tokens: list[int], windows: list[Window]) -> float:
    """llama-perplexity's score, computed with transformers: each window alone, its second half's NLL."""
    nll = []
    with torch.no_grad():
        for w in windows:
            logits = hf_model(torch.tensor([tokens[w.start:w.end]])).logits[0].double()
            log_probs = torch.log_softmax(logits, dim=-1)
            targets = torch.tensor(tokens[w.start + w.first_scored:w.end])
            nll.append(-log_probs[w.first_scored - 1:-1].gather(1, targets[:, None])[:, 0])
    return math.exp(float(torch.cat(nll).mean()))


def test_windows_follow_llama_perplexity():
    assert plan_windows(10, 4) == [Window(0, 4, 2), Window(4, 8, 2)]  # back to back, the tail dropped
    assert [w.start for w in plan_windows(10, 4, stride=2)] == [0, 2, 4, 6]
    assert len(plan_windows(100, 8, max_windows=3)) == 3
    with pytest.raises(ValueError, match="fewer than one window"):
        plan_windows(3, 4)


def test_tiny_model_perplexity_equals_transformers_and_kl_against_itself_is_zero(tiny_models, tiny_tokenizer):
    directory, hf_model = tiny_models["llama"]
    loaded = read_model(EngineConfig(model=str(directory)), "cpu", torch.float32)
    tokens = loaded.tokenizer.encode(TEXT)
    windows = plan_windows(len(tokens), 32, stride=16)
    result = evaluate(loaded.model, tokens, windows, reference=loaded.model)
    assert result["scored_tokens"] == 16 * len(windows) and len(windows) >= 3
    assert result["perplexity"] == pytest.approx(hf_perplexity(hf_model.float().eval(), tokens, windows), rel=1e-5)
    assert result["kl_divergence"] == {"mean": 0.0, "p99": 0.0, "max": 0.0}
    assert result["top1_agreement"] == 1.0 and result["perplexity_ratio"] == 1.0


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    """The default GGUF on the reference path (the suite's dense CPU layout: dequantized, fp32)."""
    return read_model(EngineConfig(model=str(smollm2_gguf)), "cpu", torch.float32)


@pytest.mark.slow
def test_smollm2_perplexity_equals_transformers(smollm2):
    """transformers' Llama with the GGUF's dequantized weights (the weights transformers' own GGUF loader
    makes: tests/test_gguf.py) scores the same windows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = smollm2.spec
    config = LlamaConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                         intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                         num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                         head_dim=spec.head_dim, rms_norm_eps=spec.rms_norm_eps, tie_word_embeddings=True,
                         max_position_embeddings=spec.max_position_embeddings,
                         rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta})
    hf_model = LlamaForCausalLM(config).eval()
    missing, unexpected = hf_model.load_state_dict(dict(smollm2.model.named_parameters()), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf_model.tie_weights()
    tokens = smollm2.tokenizer.encode(TEXT)
    windows = plan_windows(len(tokens), 64, max_windows=2)
    result = evaluate(smollm2.model, tokens, windows)
    assert result["perplexity"] == pytest.approx(hf_perplexity(hf_model, tokens, windows), rel=1e-4)


@pytest.mark.slow
def test_smollm2_rtn_w3_costs_more_than_w4_against_its_gguf(smollm2):
    """Round-to-nearest conversions of the dequantized GGUF (the loader's --quantization: group 128, 64 where
    128 does not divide SmolLM2's 576 inputs) measured against the GGUF itself."""
    tokens = smollm2.tokenizer.encode(TEXT)
    windows = plan_windows(len(tokens), 64, max_windows=2)
    kl = {}
    for bits in (4, 3):
        quantized = copy.deepcopy(smollm2.model)
        quantize_projections(quantized, bits)
        result = evaluate(quantized, tokens, windows, reference=smollm2.model)
        assert result["perplexity_ratio"] > 1.0 and 0 < result["top1_agreement"] < 1
        kl[bits] = result["kl_divergence"]["mean"]
    assert kl[3] > kl[4] > 0


def test_eval_cli_writes_json_and_a_table(tiny_models, tmp_path):
    from typer.testing import CliRunner

    from deepinfer.cli.main import app

    directory, _ = tiny_models["llama"]
    (tmp_path / "text.txt").write_text(TEXT)
    out = tmp_path / "eval.json"
    result = CliRunner().invoke(app, ["eval", "--model", str(directory), "--reference", str(directory), "--text",
                                      str(tmp_path / "text.txt"), "--ctx", "32", "--device", "cpu",
                                      "--output", str(out)])
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert payload["results"]["kl_divergence"]["mean"] == 0.0 and payload["ctx"] == 32 == payload["stride"]
    assert payload["model_name"] == "llama" and payload["text"]["tokens"] > 64
    assert "ppl ratio" in result.output and "1.0000" in result.output
    bad = CliRunner().invoke(app, ["eval", "--model", str(directory), "--text", str(tmp_path / "text.txt"),
                                   "--ctx", "100000", "--device", "cpu"])
    assert bad.exit_code != 0 and "fewer than one window" in bad.output
