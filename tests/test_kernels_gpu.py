"""The CUDA kernels against their torch references on a real GPU (marker `gpu`).

Skipped cleanly where there is no CUDA device or no CuPy. The checks are the ones
`deepinfer validate-kernels` runs (core/bench/kernel_checks.py): fresh random inputs, outputs
poisoned with NaN before each launch, relative error / cosine / max abs error against the reference.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytestmark = pytest.mark.gpu


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    from deepinfer.kernels import cuda_unavailable_reason, device_unsupported_reason

    return cuda_unavailable_reason() or device_unsupported_reason(torch.cuda.current_device())


_REASON = _skip_reason()
if _REASON is not None:
    pytest.skip(f"GPU kernels need CUDA and CuPy: {_REASON}", allow_module_level=True)

from deepinfer.core.bench import kernel_checks  # imported after the skip: CPU runs never load it
from deepinfer.core.bench.kernel_validation import check_cuda_graph, check_split_cuda_graph
from deepinfer.core.bench.model_validation import check_tiny_model
from deepinfer.kernels.quant_matmul import KERNELS

DEVICE = torch.device("cuda", torch.cuda.current_device())


def _assert_all_ok(results):
    failed = [f"{r.op} | {r.case} | rel={r.rel_err} cos={r.cosine} | {r.detail}" for r in results if not r.ok]
    assert results and not failed, "\n".join(failed)


@pytest.mark.parametrize("kernel", KERNELS)
def test_quant_matmul_kernels(kernel):
    if kernel in kernel_checks.TC_KERNEL_CASES:  # W4-only kernels, with cases of their own
        _assert_all_ok(kernel_checks.check_quant_tc(DEVICE, kernel=kernel, cases=kernel_checks.TC_KERNEL_CASES[kernel]))
        return
    cases = [case for case in kernel_checks.QUANT_CASES if case[4] == kernel]
    assert cases, f"no validation case for the {kernel} kernel"
    _assert_all_ok(kernel_checks.check_quant_matmul(DEVICE, cases=cases))


def test_dequantize_kernel_is_bit_identical_and_the_dense_path_matches():
    _assert_all_ok(kernel_checks.check_dequantize(DEVICE))


def test_paged_decode_attention_kernel():
    _assert_all_ok(kernel_checks.check_paged_attention(DEVICE))


def test_paged_prefill_attention_kernel():
    _assert_all_ok(kernel_checks.check_paged_prefill_attention(DEVICE))


def test_rms_norm_kernel():
    _assert_all_ok(kernel_checks.check_rms_norm(DEVICE))


def test_act_and_mul_kernel():
    _assert_all_ok(kernel_checks.check_act_and_mul(DEVICE))


def test_rope_cache_write_kernel():
    _assert_all_ok(kernel_checks.check_rope_cache_write(DEVICE))


def test_gate_up_product_with_the_activation_in_its_epilogue():
    _assert_all_ok(kernel_checks.check_quant_matmul_act_and_mul(DEVICE))


def test_kernels_capture_and_replay_in_a_cuda_graph():
    _assert_all_ok([check_cuda_graph(DEVICE)])


def test_split_gemv_captures_and_replays_in_a_cuda_graph():
    _assert_all_ok(check_split_cuda_graph(DEVICE))


@pytest.mark.parametrize("dtype,bits,int8_kv,tol", [(torch.float16, 4, False, 5e-3), (torch.bfloat16, 3, True, 3e-2)])
def test_tiny_model_native_matches_reference(dtype, bits, int8_kv, tol):
    _assert_all_ok([check_tiny_model(DEVICE, dtype, bits, 64, int8_kv, tol)])


def test_dispatch_takes_the_kernel_on_gpu(caplog, monkeypatch):
    from deepinfer.core.ops import dispatch
    from deepinfer.core.ops.norm import rms_norm

    monkeypatch.delenv(dispatch.FORCE_REFERENCE_ENV, raising=False)
    dispatch.reset_log()
    caplog.set_level(logging.INFO, logger="deepinfer.ops")
    x = torch.randn(4, 64, dtype=torch.float16, device=DEVICE)
    rms_norm(x, torch.ones(64, dtype=torch.float16, device=DEVICE), 1e-6)
    rms_norm(x.float(), torch.ones(64, device=DEVICE), 1e-6)  # fp32: no kernel
    messages = [r.getMessage() for r in caplog.records if r.name == "deepinfer.ops"]
    assert messages == ["rms_norm: CUDA kernel",
                        "rms_norm: torch reference (dtype torch.float32 (kernel takes float16/bfloat16))"]


@pytest.mark.parametrize("dtype,int8_kv", [(torch.float16, False), (torch.bfloat16, True)])
def test_native_backend_behind_the_fused_rope_write_matches_torch_backend(dtype, int8_kv, caplog, monkeypatch):
    """The decoder rotates q/k and writes K/V with the rope_cache_write kernel, then calls the backend with
    kv_written=True: the native backend (paged decode kernel) and the torch backend (SDPA over the same
    cache) must give the same logits over prefill, mixed and decode steps, and neither writes K/V again."""
    from deepinfer.core.attention.native_backend import NativePagedAttention
    from deepinfer.core.attention.torch_backend import TorchPagedAttention
    from deepinfer.core.bench.kernel_checks import compare
    from deepinfer.core.bench.model_validation import BLOCK_SIZE, VOCAB, build_tiny_llama
    from deepinfer.core.engine.step_inputs import SequenceChunk, build_attention_metadata
    from deepinfer.core.kv.cache import KVCache
    from deepinfer.core.ops import dispatch

    monkeypatch.delenv(dispatch.FORCE_REFERENCE_ENV, raising=False)
    dispatch.reset_log()
    caplog.set_level(logging.INFO, logger="deepinfer.ops")
    model = build_tiny_llama(dtype, DEVICE, 4, 64)
    tokens = torch.randint(0, VOCAB, (3, 48), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    tables = ([3, 7, 1, 12], [5, 0], [9])
    steps = (((0, 0, 37), (1, 0, 20)), ((0, 37, 1), (1, 20, 1), (2, 0, 9)), ((0, 38, 1), (1, 21, 1), (2, 9, 1)))

    def backend_write(*args, **kwargs):
        raise AssertionError("a backend wrote K/V that the decoder had already written")

    monkeypatch.setattr(KVCache, "write", backend_write)
    logits = {}
    for backend in (TorchPagedAttention(), NativePagedAttention()):
        model.attention_backend = backend
        spec = model.spec
        cache = KVCache(spec.num_layers, 24, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, dtype, DEVICE,
                        quantized=int8_kv)
        rows = []
        with torch.no_grad():
            for step in steps:
                chunks = [SequenceChunk(tables[i], start, count) for i, start, count in step]
                metadata, positions = build_attention_metadata(chunks, BLOCK_SIZE, DEVICE)
                input_ids = torch.cat([tokens[i, start:start + count] for i, start, count in step])
                hidden = model(input_ids, positions, metadata, cache)
                rows.append(model.compute_logits(hidden[metadata.query_start_loc[1:].long() - 1]))
        logits[backend.name] = torch.cat(rows)
    messages = [r.getMessage() for r in caplog.records if r.name == "deepinfer.ops"]
    assert "rope_cache_write: CUDA kernel" in messages and "paged_decode_attention: CUDA kernel" in messages
    _assert_all_ok([compare("end_to_end", f"native vs torch backend, kv_written, {dtype}, int8 KV {int8_kv}",
                            logits["native"], logits["torch"], 2e-2 if int8_kv else 5e-3)])


def test_merged_w4_projections_with_fused_epilogues_equal_the_unfused_kernels(caplog, monkeypatch):
    """A model whose merged q/k/v projection (K % 128 == 0, head_dim 128) and merged gate/up projection (2I >= 3K)
    the fused kernels serve: logits and KV caches must be the same bits as with the products and rope_cache_write /
    act_and_mul run one after the other, over prefill, mixed and decode steps (the q/k/v fusion takes the steps of
    at most 8 tokens, the gate/up one those of at most 32)."""
    from deepinfer.core.attention.native_backend import NativePagedAttention
    from deepinfer.core.bench.model_validation import BLOCK_SIZE, STEPS, VOCAB, build_tiny_llama
    from deepinfer.core.engine.step_inputs import SequenceChunk, build_attention_metadata
    from deepinfer.core.kv.cache import KVCache
    from deepinfer.core.models import layers
    from deepinfer.core.models.merged_projections import merge_projections
    from deepinfer.core.ops import dispatch

    monkeypatch.delenv(dispatch.FORCE_REFERENCE_ENV, raising=False)
    dispatch.reset_log()
    caplog.set_level(logging.INFO, logger="deepinfer.ops")
    dtype = torch.bfloat16
    model = build_tiny_llama(dtype, DEVICE, 4, 128, hidden_size=1024, intermediate_size=2048,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    merge_projections(model)
    model.attention_backend = NativePagedAttention()
    generator = torch.Generator().manual_seed(3)
    tokens = {name: torch.randint(0, VOCAB, (48,), generator=generator).to(DEVICE) for name in "abc"}
    tables = {"a": [3, 7, 1, 12], "b": [5, 0], "c": [9]}
    fused_ops = {name: getattr(layers, name) for name in ("qkv_rotary_and_cache_write", "gate_up_act_and_mul")}
    runs = {}
    for fused in (True, False):
        for name, op in fused_ops.items():
            monkeypatch.setattr(layers, name, op if fused else lambda *a, **k: None)
        spec = model.spec
        cache = KVCache(spec.num_layers, 24, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, dtype, DEVICE)
        rows = []
        with torch.no_grad():
            for step in STEPS:
                chunks = [SequenceChunk(tables[name], start, count) for name, start, count in step]
                metadata, positions = build_attention_metadata(chunks, BLOCK_SIZE, DEVICE)
                input_ids = torch.cat([tokens[name][start:start + count] for name, start, count in step])
                hidden = model(input_ids, positions, metadata, cache)
                rows.append(model.compute_logits(hidden[metadata.query_start_loc[1:].long() - 1]))
        runs[fused] = (torch.cat(rows), cache)
    messages = [r.getMessage() for r in caplog.records if r.name == "deepinfer.ops"]
    assert "quant_matmul_rope_cache: CUDA kernel" in messages and "quant_matmul_act_and_mul: CUDA kernel" in messages
    assert torch.equal(runs[True][0], runs[False][0])
    for layer in range(model.spec.num_layers):
        assert torch.equal(runs[True][1].key_caches[layer], runs[False][1].key_caches[layer])
        assert torch.equal(runs[True][1].value_caches[layer], runs[False][1].value_caches[layer])
