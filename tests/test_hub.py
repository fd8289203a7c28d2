"""Hugging Face ids (`--model ORG/NAME`, `ORG/NAME:QUANT`) against a real-layout HF cache, offline.

No network: HF_HUB_OFFLINE=1, or the Hub's endpoint pointed at a closed loopback port.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hf_cache import add_snapshot, model_files

from deepinfer.core.errors import ModelLoadError
from deepinfer.core.weights import hub

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hf-hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_id_resolves_to_the_cached_snapshot_of_main(hf_cache, tiny_llama_dir):
    snapshot = add_snapshot(hf_cache, "tiny-org/tiny-llama", model_files(tiny_llama_dir), COMMIT_A)
    assert hub.resolve_model("tiny-org/tiny-llama") == snapshot
    assert (snapshot / "config.json").read_text() == (tiny_llama_dir / "config.json").read_text()


def test_revision_picks_a_branch_or_a_commit(hf_cache, tiny_llama_dir):
    files = model_files(tiny_llama_dir)
    main = add_snapshot(hf_cache, "tiny-org/tiny-llama", files, COMMIT_A)
    tagged = add_snapshot(hf_cache, "tiny-org/tiny-llama", files, COMMIT_B, refs=("v1",))
    assert hub.resolve_model("tiny-org/tiny-llama", revision="v1") == tagged
    assert hub.resolve_model("tiny-org/tiny-llama", revision=COMMIT_A) == main
    with pytest.raises(ModelLoadError, match="tiny-org/tiny-llama@v2 is not in the HF cache"):
        hub.resolve_model("tiny-org/tiny-llama", revision="v2")


def test_hf_home_places_the_cache(tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = add_snapshot(tmp_path / "home" / "hub", "tiny-org/tiny-llama", model_files(tiny_llama_dir), COMMIT_A)
    assert hub.resolve_model("tiny-org/tiny-llama") == snapshot


def test_a_local_path_wins_over_a_hub_id(hf_cache, tmp_path, monkeypatch, tiny_llama_dir):
    add_snapshot(hf_cache, "tiny-org/tiny-llama", model_files(tiny_llama_dir), COMMIT_A)
    local = tmp_path / "tiny-org" / "tiny-llama"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub.resolve_model("tiny-org/tiny-llama") == Path("tiny-org/tiny-llama")
    assert hub.resolve_model("./no/such-model") == Path("./no/such-model")  # not an id: the loader says "missing"


def test_a_gguf_repo_takes_a_quant_tag_or_a_file_name(hf_cache, smollm2_gguf):
    files = {"SmolLM2-135M-Instruct.Q4_1.gguf": smollm2_gguf, "SmolLM2-135M-Instruct.Q8_0.gguf": b"GGUF",
             "README.md": b"# card"}
    snapshot = add_snapshot(hf_cache, "smol-org/SmolLM2-GGUF", files, COMMIT_A)
    q4 = snapshot / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert hub.resolve_model("smol-org/SmolLM2-GGUF:Q4_1") == q4
    assert hub.resolve_model("smol-org/SmolLM2-GGUF:q8_0") == snapshot / "SmolLM2-135M-Instruct.Q8_0.gguf"
    assert hub.resolve_model("smol-org/SmolLM2-GGUF:SmolLM2-135M-Instruct.Q4_1.gguf") == q4
    assert hub.resolve_model("smol-org/SmolLM2-GGUF") == q4  # no Q4_K_M: the first GGUF
    with pytest.raises(ModelLoadError, match="no GGUF file with quant Q5_K_M; its GGUF files: .*Q4_1.gguf"):
        hub.resolve_model("smol-org/SmolLM2-GGUF:Q5_K_M")


def test_an_index_brings_exactly_its_shards_and_a_missing_one_is_named(hf_cache, tiny_llama_dir):
    files = model_files(tiny_llama_dir)
    weights = files.pop("model.safetensors")
    files["model-00001-of-00001.safetensors"] = weights
    files["model.safetensors.index.json"] = b'{"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}'
    add_snapshot(hf_cache, "tiny-org/sharded", files, COMMIT_A)
    with pytest.raises(ModelLoadError, match="incomplete .*model-00001-of-00002.safetensors.*HF_HUB_OFFLINE"):
        hub.resolve_model("tiny-org/sharded")


def _listing(*names: str) -> list[str]:
    return list(names)


@pytest.mark.parametrize(("files", "tag", "expected"), [
    # HF weights: config, generation config, tokenizer and template files, and the weights alone;
    # the README, an ONNX export and Mistral's consolidated.safetensors stay on the Hub.
    (_listing("config.json", "generation_config.json", "model.safetensors", "consolidated.safetensors",
              "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "README.md", "onnx/model.onnx"),
     None, (["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "chat_template.jinja", "model.safetensors"], None, None)),
    (_listing("config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
              "model-00002-of-00002.safetensors", "consolidated.safetensors", "tokenizer.model"),
     None, (["config.json", "tokenizer.model", "model.safetensors.index.json"], "model.safetensors.index.json", None)),
    (_listing("config.json", "weights-a.safetensors", "weights-b.safetensors", "sub/extra.safetensors"),
     None, (["config.json", "weights-a.safetensors", "weights-b.safetensors"], None, None)),
    # A layered checkpoint: its manifest lists the files.
    (_listing("config.json", "manifest.json", "embeddings.safetensors", "layers/layer_00000.safetensors"),
     None, (["config.json", "manifest.json"], "manifest.json", None)),
    # GGUF repos, as llama.cpp's -hf picks: Q4_K_M by default, mmproj files never.
    (_listing("m-Q2_K.gguf", "m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "mmproj-m-f16.gguf"), None,
     (["m-Q4_K_M.gguf"], None, "m-Q4_K_M.gguf")),
    (_listing("m-Q2_K.gguf", "m-Q4_K_M.gguf", "m-Q4_K_S.gguf"), "Q4_K", None),
    (_listing("m-Q2_K.gguf", "m-Q4_K_M.gguf", "m-Q4_K_S.gguf"), "q4_k_s", (["m-Q4_K_S.gguf"], None, "m-Q4_K_S.gguf")),
    (_listing("Q8_0/m-Q8_0.gguf", "m-Q4_0.gguf"), "Q8_0", (["Q8_0/m-Q8_0.gguf"], None, "Q8_0/m-Q8_0.gguf")),
])
def test_only_what_deepinfer_reads_is_selected(files, tag, expected):
    ref = hub.HubRef("org/name", tag)
    if expected is None:
        with pytest.raises(ModelLoadError, match="no GGUF file with quant"):
            hub.select_weights(files, ref)
    else:
        assert hub.select_weights(files, ref) == expected


def test_split_ggufs_and_tags_on_weight_repos_are_one_line_errors():
    with pytest.raises(ModelLoadError, match="split GGUF"):
        hub.select_weights(["m-Q4_K_M-00001-of-00002.gguf", "m-Q4_K_M-00002-of-00002.gguf"], hub.HubRef("o/n", None))
    with pytest.raises(ModelLoadError, match="has no GGUF files"):
        hub.select_weights(["config.json", "model.safetensors"], hub.HubRef("o/n", "Q4_K_M"))


@pytest.mark.parametrize(("text", "ref"), [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", hub.HubRef("HuggingFaceTB/SmolLM2-135M-Instruct", None)),
    ("bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M", hub.HubRef("bartowski/Qwen2.5-0.5B-Instruct-GGUF", "Q4_K_M")),
    ("./models/x", None), ("/abs/path", None), ("a/b/c", None), ("name-only", None), ("../up/x", None),
    ("~/models/x", None),
])
def test_what_reads_as_a_hub_id(text, ref):
    assert hub.parse_hub_id(text) == ref


def _cli(args: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer", *args], check=False, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env})


def test_chat_on_a_hub_id_answers_as_the_local_copy_does(hf_cache, tiny_llama_dir):
    add_snapshot(hf_cache, "tiny-org/tiny-llama", model_files(tiny_llama_dir), COMMIT_A)
    args = ["chat", "--prompt", "Hello", "--temperature", "0", "--max-tokens", "6"]
    env = {"HF_HUB_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "1"}
    from_hub = _cli([*args, "--model", "tiny-org/tiny-llama"], env)
    local = _cli([*args, "--model", str(tiny_llama_dir)], env)
    assert from_hub.returncode == 0, from_hub.stderr
    assert from_hub.stdout == local.stdout and from_hub.stdout.strip()


def test_an_unknown_id_offline_is_one_line_naming_the_cache(hf_cache):
    result = _cli(["chat", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--prompt", "hi"],
                  {"HF_HUB_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert str(hf_cache) in lines[0] and "HF_HUB_OFFLINE" in lines[0]


def test_an_unreachable_hub_falls_back_to_the_cache_then_says_why(tmp_path, tiny_llama_dir):
    # The Hub's endpoint is a loopback port nobody listens on: every request is refused at once.
    cache = tmp_path / "hf-hub"
    add_snapshot(cache, "tiny-org/tiny-llama", model_files(tiny_llama_dir), COMMIT_A)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0",
           "HF_HUB_ETAG_TIMEOUT": "2", "HF_HUB_DOWNLOAD_TIMEOUT": "2"}
    probe = ("import sys\nfrom deepinfer.core.weights.hub import resolve_model\n"
             "try:\n    print(resolve_model(sys.argv[1]))\nexcept Exception as err:\n    print('ERR', err)\n")
    cached = subprocess.run([sys.executable, "-c", probe, "tiny-org/tiny-llama"], check=False, capture_output=True,
                            text=True, timeout=120, env=env)
    assert cached.stdout.strip() == str(cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT_A), cached.stderr
    missing = subprocess.run([sys.executable, "-c", probe, "tiny-org/absent"], check=False, capture_output=True,
                             text=True, timeout=120, env=env)
    assert missing.stdout.startswith("ERR tiny-org/absent is not a local path"), missing.stdout + missing.stderr
    assert str(cache) in missing.stdout and "could not be reached" in missing.stdout
