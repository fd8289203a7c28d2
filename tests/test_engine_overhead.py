"""The host-overhead paths of an engine step: kernel lookup, cached dispatch decisions, the reused
PackedWeight, the decoder's fused RoPE + KV write (backends called with kv_written=True), and
O(1) output snapshots. Each is checked for the behaviour it must keep, not only for speed."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from deepinfer.core.attention.native_backend import NativePagedAttention
from deepinfer.core.attention.torch_backend import TorchPagedAttention
from deepinfer.core.engine.frontend.output_processor import OutputProcessor, RequestGroup
from deepinfer.core.engine.sampling_params import SamplingParams
from deepinfer.core.engine.sched.request import Request
from deepinfer.core.engine.stats import IterationStats
from deepinfer.core.engine.worker.step_inputs import SequenceChunk, build_attention_metadata
from deepinfer.core.kv.cache import KVCache
from deepinfer.core.ops import dispatch
from deepinfer.core.ops.rotary import write_kv_cache
from deepinfer.core.quant.quant_linear import QuantLinear
from deepinfer.core.quant.rtn import quantize_rtn
from deepinfer.core.tokenizer import ByteTokenizer

pytestmark = pytest.mark.usefixtures("fresh_dispatch")


def test_get_kernel_compiles_once_then_skips_hashing(monkeypatch):
    from deepinfer.kernels import compiler

    built = []

    class FakeFunction:
        def compile(self):
            pass

    class FakeModule:
        def __init__(self, code, options, name_expressions):
            built.append((options, tuple(name_expressions)))

        def get_function(self, name):
            return FakeFunction()

    class FakeDevice:
        compute_capability = "90"

        def __init__(self, index):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    fake_cupy = types.SimpleNamespace(RawModule=FakeModule, cuda=types.SimpleNamespace(Device=FakeDevice))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(compiler, "_kernels", {})
    monkeypatch.setattr(compiler, "_loaded", {})
    compiler.device_arch.cache_clear()
    try:
        first = compiler.get_kernel("rms_norm.cu", "rms_norm_kernel<0,1,0>", 7)
        hashed = compiler.source_hash.cache_info().misses + compiler.source_hash.cache_info().hits
        for _ in range(50):
            assert compiler.get_kernel("rms_norm.cu", "rms_norm_kernel<0,1,0>", 7) is first
        assert compiler.source_hash.cache_info().misses + compiler.source_hash.cache_info().hits == hashed
        assert built == [(("-std=c++17", "--gpu-architecture=sm_90"), ("rms_norm_kernel<0,1,0>",))]
        assert compiler.compiled_kernels()[0]["arch"] == "sm_90"
    finally:
        compiler.device_arch.cache_clear()  # forget the fake device's arch


def test_decide_runs_the_checks_once_per_key_and_env_setting(monkeypatch):
    calls = []

    def reason(case, calls=calls):  # a check reads only its case (decide refuses closures)
        calls.append(case)
        return "not served"

    cpu = (torch.device("cpu"),)
    monkeypatch.setattr(dispatch, "kernel_blocker", lambda devices: None)
    for _ in range(5):
        assert not dispatch.decide("op", (cpu, 1), reason)
    assert calls == [(cpu, 1)]
    assert not dispatch.decide("op", (cpu, 2), reason)  # another case: checked again
    assert len(calls) == 2
    monkeypatch.setenv(dispatch.FORCE_REFERENCE_ENV, "1")  # the env setting is part of the key
    assert not dispatch.decide("op", (cpu, 1), reason)
    assert len(calls) == 3
    assert dispatch.decide("op2", (cpu, 1), lambda case: None)
    weight = torch.zeros(2, requires_grad=True)
    assert not dispatch.decide("op2", (cpu, 1), lambda case: None, (weight,))  # autograd records it: reference
    with torch.no_grad():
        assert dispatch.decide("op2", (cpu, 1), lambda case: None, (weight,))
    assert len(calls) == 3
    assert dispatch.logged_paths()["op2"] == ["kernel", dispatch.AUTOGRAD_REASON]


def test_cached_decisions_still_follow_the_env_switch(caplog):
    from deepinfer.core.ops.norm import rms_norm

    x, weight = torch.randn(3, 16), torch.randn(16)
    with torch.no_grad():
        rms_norm(x, weight, 1e-6)
        assert "tensors are not on a CUDA device" in dispatch.logged_paths()["rms_norm"]
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(dispatch.FORCE_REFERENCE_ENV, "1")
            rms_norm(x, weight, 1e-6)
        assert f"{dispatch.FORCE_REFERENCE_ENV}=1" in dispatch.logged_paths()["rms_norm"]


def test_quant_linear_reuses_its_packed_weight_until_a_buffer_changes():
    packed = quantize_rtn(torch.randn(48, 64), bits=4, group_size=32, bias=torch.randn(48))
    layer = QuantLinear(packed)
    first = layer.packed
    assert layer.packed is first
    x = torch.randn(3, 64)
    expected = x @ _dequantized(layer).T + layer.bias
    torch.testing.assert_close(layer(x), expected)

    layer.half()  # the bias becomes fp16, scales keep their dtype through integer views: new buffers
    rebuilt = layer.packed
    assert rebuilt is not first and rebuilt.bias.dtype == torch.float16 and rebuilt.bias is layer.bias
    assert rebuilt.scales is layer.scales and rebuilt.scales.dtype == packed.scales.dtype

    layer.float()
    layer.bias = torch.zeros(48)  # assignment replaces the buffer
    assert layer.packed.bias is layer.bias
    torch.testing.assert_close(layer(x), x @ _dequantized(layer).T)


def _dequantized(layer: QuantLinear) -> torch.Tensor:
    from deepinfer.core.quant.packing import dequantize

    return dequantize(layer.packed, torch.float32)


@pytest.mark.parametrize("backend_type", [TorchPagedAttention, NativePagedAttention])
@pytest.mark.parametrize("quantized", [None, "int8", "fp8"])
def test_backend_with_kv_written_attends_over_what_the_caller_wrote(backend_type, quantized):
    block_size, heads, kv_heads, head_dim = 4, 4, 2, 8
    chunks = [SequenceChunk([3, 1], 5, 1), SequenceChunk([0, 2, 6], 0, 9)]  # a decode, then a prefill
    metadata, _ = build_attention_metadata(chunks, block_size, "cpu")
    query, key, value = torch.randn(10, heads, head_dim), torch.randn(10, kv_heads, head_dim), torch.randn(10, 2, 8)
    caches = []
    for _ in range(2):
        torch.manual_seed(0)
        cache = KVCache(1, 8, block_size, kv_heads, head_dim, torch.float32, "cpu", quantized)
        cache.write(0, torch.randn(32, kv_heads, head_dim), torch.randn(32, kv_heads, head_dim), torch.arange(32))
        caches.append(cache)
    expected = backend_type().forward(0, query, key, value, metadata, caches[0], 0.35, None, None)
    written = caches[1]
    write_kv_cache(key, value, written.key_caches[0], written.value_caches[0], metadata.slot_mapping,
                   written.key_scales[0] if quantized else None, written.value_scales[0] if quantized else None)
    poison = torch.full_like(key, math.nan)  # key/value must not be read again
    got = backend_type().forward(0, query, poison, poison, metadata, written, 0.35, None, None, kv_written=True)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for name in ("key_caches", "value_caches") + (("key_scales", "value_scales") if quantized else ()):
        assert torch.equal(getattr(written, name)[0], getattr(caches[0], name)[0]), name


def test_decoder_writes_kv_once_per_layer_through_the_fused_op(monkeypatch):
    from transformers import LlamaConfig

    from deepinfer.core.models.decoder import DecoderModel
    from deepinfer.core.models.spec import ModelSpec
    from deepinfer.core.ops import rotary

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = DecoderModel(ModelSpec.from_hf_config(config.to_dict()), max_positions=64)
    model.init_dummy_weights(seed=1)
    cache = KVCache(3, 8, 4, 2, 8, torch.float32, "cpu")
    metadata, positions = build_attention_metadata([SequenceChunk([2, 5], 0, 6)], 4, "cpu")
    fused = []
    original = rotary.rotary_and_cache_write

    def counting(*args, **kwargs):
        fused.append(args[5].data_ptr())  # which layer's key cache
        return original(*args, **kwargs)

    def no_backend_write(*args, **kwargs):
        raise AssertionError("the backend wrote K/V the decoder had already written")

    monkeypatch.setattr("deepinfer.core.models.layers.rotary_and_cache_write", counting)
    monkeypatch.setattr(KVCache, "write", no_backend_write)
    with torch.no_grad():
        model(torch.arange(6), positions, metadata, cache)
    assert fused == [cache.key_caches[i].data_ptr() for i in range(3)]
    assert all(bool(cache.key_caches[i][2].abs().sum() > 0) for i in range(3))  # slots 8..11 hold tokens 0..3


def _processor_with_one_request(logprobs: int | None = None) -> tuple[OutputProcessor, Request]:
    params = SamplingParams(max_tokens=50, ignore_eos=True, logprobs=logprobs)
    request = Request("r", [65, 66], params)
    processor = OutputProcessor(ByteTokenizer(256))
    processor.add(RequestGroup("r", None, [65, 66], params, [request]))
    return processor, request


def _step(processor: OutputProcessor, request: Request, token: int):
    from deepinfer.core.engine.frontend.outputs import TokenLogprob

    request.append_output_token(token)
    if request.logprobs is not None:
        request.logprobs.append(TokenLogprob(token, -0.5, [(token, -0.5)]))
    stats = IterationStats()
    processor.append_tokens([request], stats)
    (output,) = processor.make_outputs([request], stats)
    return output


def test_snapshots_keep_their_step_while_the_stream_goes_on():
    processor, request = _processor_with_one_request(logprobs=1)
    outputs = [_step(processor, request, token) for token in b"hello"]
    for step, output in enumerate(outputs):  # read only after all steps ran
        completion = output.outputs[0]
        assert completion.token_ids == list(b"hello"[:step + 1])
        assert [entry.token_id for entry in completion.logprobs] == list(b"hello"[:step + 1])
        assert completion.delta_token_ids == [b"hello"[step]]
        assert [entry.token_id for entry in completion.delta_logprobs] == [b"hello"[step]]
        assert completion.text == "hello"[:step + 1] and completion.delta_text == "hello"[step]
    assert "".join(o.outputs[0].delta_text for o in outputs) == "hello"
    first = outputs[0].outputs[0]
    first.token_ids.append(0)  # a caller's list is its own
    assert outputs[1].outputs[0].token_ids == list(b"he")
    assert outputs[-1].token_ids == list(b"hello")


def test_snapshot_without_logprobs_and_the_metrics_of_one_sample():
    processor, request = _processor_with_one_request()
    output = _step(processor, request, 72)
    assert output.outputs[0].logprobs is None and output.outputs[0].delta_logprobs is None
    metrics = output.metrics
    assert metrics.arrival_time == request.metrics.arrival_time
    assert metrics.first_token_time == request.metrics.first_token_time is not None
    assert metrics.finished_time is None
    assert metrics is not request.metrics  # a snapshot, not the live record
