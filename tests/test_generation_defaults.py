"""Sampling defaults from the model: generation_config.json (HF, layered), GGUF general.sampling.*
metadata, a conversion carrying them; overridden by the sampling flags, then by each request's
fields, in LLM, both server endpoints and chat; benchmarks keep their own sampling."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import save_tiny_model

from deepinfer import LLM, SamplingParams
from deepinfer.core.config import EngineConfig
from deepinfer.core.engine.sampling_params import SamplingDefaults
from deepinfer.core.errors import ModelLoadError

QWEN_LIKE = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}  # Qwen2.5-Instruct's
ENGINE = {"device": "cpu", "num_gpu_blocks": 64, "max_num_seqs": 8}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer):
    directory = tmp_path_factory.mktemp("generation_defaults") / "llama"
    save_tiny_model("llama", directory, tiny_tokenizer, seed=3, initializer_range=0.2, num_hidden_layers=1)
    config = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps({**config, **QWEN_LIKE, "do_sample": True}))
    return directory


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), **ENGINE)


def sampled(llm, params_list):
    prompts = [[5, 6, 7, 8, 9, 10]] * len(params_list)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params_list)]


def test_llm_fills_only_the_unset_fields_from_generation_config(llm):
    defaults = llm.sampling_defaults
    assert {k: defaults.values[k] for k in QWEN_LIKE} == QWEN_LIKE
    assert defaults.sources == {"temperature": "model", "top_p": "model", "top_k": "model", "min_p": "built-in",
                                "repetition_penalty": "model", "presence_penalty": "built-in",
                                "frequency_penalty": "built-in"}
    assert defaults.model_source == "generation_config.json"
    # The reference: the same requests with the values written out.
    unset = SamplingParams(seed=4, max_tokens=10, ignore_eos=True)
    written = replace(unset, min_p=0.0, **QWEN_LIKE)
    half = replace(unset, temperature=1.3, top_k=0)  # the request's own values win
    half_written = replace(half, top_p=0.8, min_p=0.0, repetition_penalty=1.05)
    plain = replace(unset, temperature=1.3, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
    got = sampled(llm, [unset, written, half, half_written, plain])
    assert got[0] == got[1] and got[2] == got[3]
    assert got[2] != got[4]  # the model's top_p / repetition penalty changed the half-set request's tokens
    assert llm.get_default_sampling_params().top_k == 20


def test_flags_override_the_model_and_requests_override_the_flags(model_dir):
    llm = LLM(str(model_dir), override_generation_config={"temperature": 0.0, "min_p": 0.2}, **ENGINE)
    defaults = llm.sampling_defaults
    assert defaults.values["temperature"] == 0.0 and defaults.sources["temperature"] == "flag"
    assert defaults.sources["min_p"] == "flag" and defaults.sources["top_k"] == "model"
    assert "top_p 0.8" in defaults.describe() and "(flag)" in defaults.describe()
    greedy_by_flag, greedy_written = sampled(llm, [SamplingParams(max_tokens=8, ignore_eos=True),
                                                   SamplingParams(temperature=0.0, repetition_penalty=1.05,
                                                                  max_tokens=8, ignore_eos=True)])
    assert greedy_by_flag == greedy_written


def test_bad_overrides_and_bad_model_values_are_clear_errors(model_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown field 'temprature'"):
        EngineConfig(override_generation_config={"temprature": 0.5})
    with pytest.raises(ValueError, match="top_p must be"):
        EngineConfig(override_generation_config={"top_p": 0.0})
    from deepinfer.core.weights.generation_defaults import read_generation_config

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ModelLoadError, match="generation_config.json: sampling default temperature must be a number"):
        read_generation_config(tmp_path)


def test_engines_take_params_as_given(model_dir):
    """LLMEngine / AsyncEngine (what benchmarks drive) read no defaults: unset means built-in."""
    from deepinfer.core.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model_dir), **ENGINE))
    group = engine.make_request_group([5, 6, 7], SamplingParams(max_tokens=2))
    params = group.samples[0].params
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (1.0, 1.0, 0, 1.0)


def test_a_converted_gguf_carries_its_sampling_metadata(tmp_path, monkeypatch):
    """GGUF general.sampling.* (written by gguf-py's own writer) -> the model's defaults, and after
    `deepinfer convert` the layered checkpoint's generation_config.json holds them."""
    import gguf
    from conftest import tiny_hf_config
    from test_gguf import write_gguf_like_llama_cpp
    from transformers import AutoModelForCausalLM

    from deepinfer.core.models.loader import load_model
    from deepinfer.core.weights.convert.run import convert_checkpoint
    from deepinfer.core.weights.generation_defaults import gguf_generation_defaults
    from deepinfer.core.weights.gguf_reader import open_gguf

    class SamplingWriter(gguf.GGUFWriter):
        def write_header_to_file(self, *args, **kwargs):
            self.add_sampling_temp(0.25)
            self.add_sampling_top_k(12)
            self.add_sampling_penalty_repeat(1.2)
            return super().write_header_to_file(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFWriter", SamplingWriter)
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(tiny_hf_config("llama", num_hidden_layers=1)).eval()
    path = tmp_path / "tiny.gguf"
    write_gguf_like_llama_cpp(hf_model, "llama", path)
    monkeypatch.undo()
    expected = {"temperature": 0.25, "top_k": 12, "repetition_penalty": 1.2}
    own = gguf_generation_defaults(open_gguf(path), path)  # what the loader attaches to the model
    assert own.source == "GGUF metadata" and own.values == pytest.approx(expected)
    out = tmp_path / "layered"
    convert_checkpoint(path, out)
    assert json.loads((out / "generation_config.json").read_text()) == pytest.approx(expected)
    layered = load_model(EngineConfig(model=str(out)), "cpu", torch.float32)
    assert layered.generation_defaults.values == pytest.approx(expected)
    assert layered.generation_defaults.source == "generation_config.json"


def test_a_converted_hf_directory_keeps_its_defaults(model_dir, tmp_path):
    from deepinfer.core.models.loader import load_model
    from deepinfer.core.weights.convert.run import convert_checkpoint

    out = tmp_path / "layered"
    convert_checkpoint(model_dir, out)
    assert load_model(EngineConfig(model=str(out)), "cpu", torch.float32).generation_defaults.values == QWEN_LIKE


def test_both_endpoints_fill_unset_fields_with_the_defaults(model_dir):
    from deepinfer.core.engine.frontend.async_engine import AsyncEngine
    from deepinfer.core.server.config import ServerConfig
    from deepinfer.core.server.serving import ServingEngine
    from deepinfer.core.server.serving_chat import prepare_chat
    from deepinfer.core.server.serving_completions import prepare_completion

    engine = AsyncEngine(EngineConfig(model=str(model_dir), override_generation_config={"min_p": 0.05}, **ENGINE))
    serving = ServingEngine(engine, ServerConfig())
    chat_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "top_k": 3}
    _, chat = prepare_chat(serving, json.dumps(chat_body).encode())
    _, (completion,) = prepare_completion(serving, json.dumps({"prompt": "hi", "temperature": 0}).encode())
    for params, own in ((chat.prompt.params, {"top_k": 3}), (completion.params, {"temperature": 0.0})):
        want = {**QWEN_LIKE, "min_p": 0.05, **own}
        assert {k: getattr(params, k) for k in want} == want


def test_chat_and_serve_sampling_flags_reach_engine_config_and_benchmarks_have_none(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from deepinfer.cli import options
    from deepinfer.cli.main import app

    seen = {}

    class Stop(Exception):
        pass

    def recording_config(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(options, "EngineConfig", recording_config)
    flags = ["--temperature", "0.3", "--top-p", "0.5", "--top-k", "7", "--min-p", "0.1", "--repetition-penalty", "1.2"]
    for command in (["chat", "--prompt", "hi"], ["serve"]):
        seen.clear()
        result = CliRunner().invoke(app, [*command, "--model", str(tmp_path), *flags])
        assert isinstance(result.exception, Stop), result.output
        assert seen["override_generation_config"] == {"temperature": 0.3, "top_p": 0.5, "top_k": 7, "min_p": 0.1,
                                                      "repetition_penalty": 1.2}
    for command in (["bench", "concurrency"], ["bench", "jitter"]):
        result = CliRunner().invoke(app, [*command, "--temperature", "0.3"])
        assert result.exit_code == 2 and "--temperature" in result.output  # no such option


def test_the_repl_says_which_defaults_are_in_force_and_from_where(capsys):
    from deepinfer.cli.conversation import Conversation
    from deepinfer.cli.repl import ChatRepl

    defaults = SamplingDefaults.layer({"temperature": 0.2, "repetition_penalty": 1.1}, "generation_config.json",
                                      {"top_p": 0.7})
    chat = SimpleNamespace(engine=SimpleNamespace(tokenizer=None, max_model_len=64))
    repl = ChatRepl(chat, SamplingParams().with_defaults(defaults), Conversation(None), "tiny", None, defaults)
    repl.console.width = 200
    repl.command("/help")
    shown = capsys.readouterr().out
    assert ("sampling: temperature 0.2, repetition_penalty 1.1 (model: generation_config.json); top_p 0.7 (flag); "
            "top_k off, min_p 0, presence_penalty 0, frequency_penalty 0 (built-in)") in shown
