"""core/ops dispatch on the CPU: every op falls back to its torch reference, says why once per
(op, reason), and DEEPINFER_FORCE_REFERENCE=1 wins over everything. The references themselves are
checked against independent implementations (the decoder's layers, KVCache.write,
TorchPagedAttention, hand formulas), since the GPU kernels are validated against them."""

from __future__ import annotations

import logging
import math
import re

import numpy as np
import pytest
import torch

from deepinfer.core.attention.native_backend import NativePagedAttention
from deepinfer.core.attention.torch_backend import TorchPagedAttention
from deepinfer.core.engine.worker.step_inputs import SequenceChunk, build_attention_metadata
from deepinfer.core.kv.cache import KVCache
from deepinfer.core.ops import dispatch
from deepinfer.core.ops.activation import act_and_mul
from deepinfer.core.ops.norm import rms_norm
from deepinfer.core.ops.paged_attention import paged_decode_attention, paged_prefill_attention
from deepinfer.core.ops.quant_matmul import quant_matmul, quant_matmul_reference
from deepinfer.core.ops.rotary import rotary_and_cache_write, write_kv_cache
from deepinfer.core.quant.rtn import quantize_rtn

pytestmark = pytest.mark.usefixtures("fresh_dispatch")


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "deepinfer.ops"]


def test_cpu_falls_back_and_logs_once_per_op_and_reason(caplog):
    caplog.set_level(logging.INFO, logger="deepinfer.ops")
    x, weight = torch.randn(3, 16), torch.randn(16)
    for _ in range(3):
        rms_norm(x, weight, 1e-6)
    act_and_mul(torch.randn(2, 8), torch.randn(2, 8), "silu")
    act_and_mul(torch.randn(2, 8), torch.randn(2, 8), "silu")
    assert _messages(caplog) == ["rms_norm: torch reference (tensors are not on a CUDA device)",
                                 "act_and_mul: torch reference (tensors are not on a CUDA device)"]


def test_force_reference_env_is_the_reason(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="deepinfer.ops")
    monkeypatch.setenv(dispatch.FORCE_REFERENCE_ENV, "1")
    assert dispatch.force_reference()
    assert dispatch.kernel_blocker((torch.device("cpu"),)) == "DEEPINFER_FORCE_REFERENCE=1"
    rms_norm(torch.randn(2, 8), torch.randn(8), 1e-6)
    assert _messages(caplog) == ["rms_norm: torch reference (DEEPINFER_FORCE_REFERENCE=1)"]
    monkeypatch.setenv(dispatch.FORCE_REFERENCE_ENV, "0")
    assert not dispatch.force_reference()


def test_use_kernel_logs_the_kernel_path_once(caplog):
    caplog.set_level(logging.INFO, logger="deepinfer.ops")
    assert dispatch.use_kernel("some_op", None) and dispatch.use_kernel("some_op", None)
    assert not dispatch.use_kernel("some_op", "head_dim 80")
    assert _messages(caplog) == ["some_op: CUDA kernel", "some_op: torch reference (head_dim 80)"]


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_reference_matches_decoder_norm_and_formula(offset):
    from deepinfer.core.models.layers import RMSNorm

    hidden, dtype = 24, torch.bfloat16
    x, residual = torch.randn(5, hidden).to(dtype), torch.randn(5, hidden).to(dtype)
    norm = RMSNorm(hidden, 1e-6, offset, dtype, "cpu")
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden))
    out, summed = rms_norm(x, norm.weight, 1e-6, offset, residual)
    assert torch.equal(summed, x + residual)
    assert torch.equal(out, norm(x + residual))
    s = (x + residual).double()
    by_hand = s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * (offset + norm.weight.double())
    torch.testing.assert_close(out.double(), by_hand, rtol=2e-2, atol=2e-2)


def test_act_and_mul_reference_formulas():
    gate, up = torch.randn(4, 16, dtype=torch.float64), torch.randn(4, 16, dtype=torch.float64)
    torch.testing.assert_close(act_and_mul(gate, up, "silu"), gate * torch.sigmoid(gate) * up)
    tanh_gelu = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)))
    torch.testing.assert_close(act_and_mul(gate, up, "gelu_tanh"), tanh_gelu * up)
    with pytest.raises(ValueError):
        act_and_mul(gate, up, "relu")


@pytest.mark.parametrize("quantized", [None, "int8", "fp8"])
def test_rotary_and_cache_write_matches_hf_rope_and_kv_cache(quantized):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    tokens, heads, kv_heads, head_dim, block_size = 6, 4, 2, 16, 4
    query, key = torch.randn(tokens, heads, head_dim), torch.randn(tokens, kv_heads, head_dim)
    value = torch.randn(tokens, kv_heads, head_dim)
    angles = torch.rand(tokens, head_dim // 2) * 10
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([3, 17, 4, 9, 30, 0])
    expected = KVCache(1, 8, block_size, kv_heads, head_dim, torch.float32, "cpu", quantized)
    got = KVCache(1, 8, block_size, kv_heads, head_dim, torch.float32, "cpu", quantized)
    rotated_q, rotated_k = rotary_and_cache_write(
        query, key, value, cos.unsqueeze(1), sin.unsqueeze(1), got.key_caches[0], got.value_caches[0], slots,
        got.key_scales[0] if quantized else None, got.value_scales[0] if quantized else None)
    # HF: [batch, heads, T, D] with cos/sin [batch, T, D] (the half table repeated)
    hf_q, hf_k = apply_rotary_pos_emb(query.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                      torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None])
    torch.testing.assert_close(rotated_q, hf_q[0].transpose(0, 1))
    torch.testing.assert_close(rotated_k, hf_k[0].transpose(0, 1))
    expected.write(0, rotated_k, value, slots)
    for name in ("key_caches", "value_caches") + (("key_scales", "value_scales") if quantized else ()):
        assert torch.equal(getattr(got, name)[0], getattr(expected, name)[0]), name
    # the cache write alone, on other slots
    write_kv_cache(key, value, got.key_caches[0], got.value_caches[0], slots + 1,
                   got.key_scales[0] if quantized else None, got.value_scales[0] if quantized else None)
    expected.write(0, key, value, slots + 1)
    assert torch.equal(got.value_caches[0], expected.value_caches[0])


@pytest.mark.parametrize("window,softcap,quantized", [(None, None, None), (5, None, None), (None, 20.0, "int8"),
                                                       (5, 20.0, "fp8")])
def test_paged_decode_reference_matches_torch_backend(window, softcap, quantized):
    heads, kv_heads, head_dim, block_size = 6, 2, 8, 4
    cache = KVCache(1, 16, block_size, kv_heads, head_dim, torch.float32, "cpu", quantized)
    tables = [[5, 2, 9], [0, 11], [7, 3, 14, 1]]
    lengths = [10, 6, 13]
    for table, length in zip(tables, lengths):  # fill the contexts
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(length)])
        cache.write(0, torch.randn(length, kv_heads, head_dim), torch.randn(length, kv_heads, head_dim), slots)
    chunks = [SequenceChunk(table, length - 1, 1) for table, length in zip(tables, lengths)]
    metadata, _ = build_attention_metadata(chunks, block_size, "cpu")
    query = torch.randn(3, heads, head_dim)
    last_key, last_value = torch.randn(3, kv_heads, head_dim), torch.randn(3, kv_heads, head_dim)
    expected = TorchPagedAttention().forward(0, query, last_key, last_value, metadata, cache, 0.3, window, softcap)
    got = paged_decode_attention(query, cache.key_caches[0], cache.value_caches[0], metadata.block_tables,
                                 metadata.seq_lens, 0.3, window, softcap,
                                 cache.key_scales[0] if quantized else None,
                                 cache.value_scales[0] if quantized else None)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,softcap,quantized", [(None, None, None), (4, None, None), (None, 15.0, None),
                                                       (4, None, "int8"), (None, 15.0, "fp8")])
def test_paged_prefill_reference_is_causal_attention_of_each_tile_token(window, softcap, quantized):
    """The prefill op (its reference on the CPU) against attention written out by hand: a token at position p
    of a sequence attends to that sequence's keys 0..p (with a window W only p-W+1..p) through query head h's KV
    head h // G, over contiguous K/V (an int8 or e4m3 cache's codes times their scales); rows outside the tiles keep
    what `out` held."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size, scale = 6, 2, 8, 4, 0.3
    cache = KVCache(1, 16, block_size, kv_heads, head_dim, torch.float32, "cpu", quantized)
    tables, lengths = [[5, 2, 9], [0, 11, 4, 7]], [11, 14]
    keys, values = [], []
    for table, length in zip(tables, lengths):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(length)])
        cache.write(0, torch.randn(length, kv_heads, head_dim), torch.randn(length, kv_heads, head_dim), slots)
        # what the cache holds, position-major: [length, KVH, D] (codes times scales where quantized)
        held = [codes.permute(0, 2, 1, 3).reshape(-1, kv_heads, head_dim)[:length]
                for codes in cache.read_blocks(0, torch.tensor(table))]
        keys.append(held[0])
        values.append(held[1])
    scales = (cache.key_scales[0], cache.value_scales[0]) if quantized else (None, None)
    # row 0: outside every tile; sequence 0 positions 3..10 in tiles of 3, 3, 2; sequence 1 positions 9..13
    rows = [(0, 10)] + [(0, p) for p in range(3, 11)] + [(1, p) for p in range(9, 14)]
    tiles = torch.tensor([[1, 3], [4, 3], [7, 2], [9, 5], [0, 0]], dtype=torch.int32)
    block_tables = torch.tensor([(tables[s] + [0])[:4] for s, _ in rows], dtype=torch.int32)
    seq_lens = torch.tensor([p + 1 for _, p in rows], dtype=torch.int32)
    query = torch.randn(len(rows), heads, head_dim)
    out = torch.full_like(query, 7.0)
    got = paged_prefill_attention(query, cache.key_caches[0], cache.value_caches[0], block_tables, seq_lens, tiles,
                                  scale, window, softcap, *scales, out=out)
    assert got is out and torch.equal(out[0], torch.full_like(out[0], 7.0))
    for row, (seq, position) in enumerate(rows[1:], start=1):
        first = 0 if window is None else max(0, position + 1 - window)
        for head in range(heads):
            k = keys[seq][first:position + 1, head // (heads // kv_heads)]  # [S, D]
            v = values[seq][first:position + 1, head // (heads // kv_heads)]
            scores = k @ query[row, head] * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            expected = torch.softmax(scores, dim=0) @ v
            torch.testing.assert_close(out[row, head], expected, rtol=1e-5, atol=1e-5)


def test_native_backend_on_cpu_equals_torch_backend():
    block_size, kv_heads, head_dim = 4, 2, 8
    chunks = [SequenceChunk([3, 1], 5, 1), SequenceChunk([0, 2, 6], 0, 9)]
    metadata, _ = build_attention_metadata(chunks, block_size, "cpu")
    query, key, value = torch.randn(10, 4, head_dim), torch.randn(10, kv_heads, head_dim), torch.randn(10, 2, 8)
    outputs = []
    for backend in (TorchPagedAttention(), NativePagedAttention()):
        torch.manual_seed(0)
        cache = KVCache(1, 8, block_size, kv_heads, head_dim, torch.float32, "cpu")
        cache.key_caches[0].normal_()
        cache.value_caches[0].normal_()
        outputs.append(backend.forward(0, query, key, value, metadata, cache, 0.35, None, None))
    torch.testing.assert_close(outputs[1], outputs[0])


def test_quant_matmul_on_cpu_is_the_reference():
    packed = quantize_rtn(torch.randn(48, 64), bits=4, group_size=32, bias=torch.randn(48))
    x = torch.randn(3, 64)
    assert torch.equal(quant_matmul(x, packed), quant_matmul_reference(x, packed))


def test_kernel_arguments_are_exactly_typed():
    from deepinfer.kernels.launch import f32, i32, i64, launch, ptr

    assert f32(0.125).dtype == np.float32 and f32(0.125).itemsize == 4
    assert i32(7).dtype == np.int32 and i64(7).dtype == np.int64
    assert ptr(None) == 0 and ptr(torch.zeros(2)).dtype == np.uint64
    with pytest.raises(ValueError):
        i32(2**31)
    with pytest.raises(TypeError, match="must be typed"):
        launch(None, (1, 1, 1), (32, 1, 1), (np.float32(1.0), 0.5), 0)  # a bare float is refused


def test_registry_instantiations_name_templates_of_their_sources():
    from deepinfer.kernels import registry
    from deepinfer.kernels.compiler import source_hash, source_text

    for op in registry.OPS.values():
        text = source_text(op.source)
        assert text.count("struct Num<0>") == 1  # common.cuh inlined exactly once
        assert "#include" not in text
        assert len(source_hash(op.source)) == 16
        for name in op.instantiations:
            template = name.split("<")[0]
            assert re.search(rf"__global__ void (__launch_bounds__\([^)]+\) )?{template}\(", text), name


def test_split_and_tile_choices(monkeypatch):
    from deepinfer.kernels import paged_attention
    from deepinfer.kernels import quant_matmul as kq

    monkeypatch.setattr(paged_attention, "_device_limits", lambda index: (132, 2048, 65536, 32))
    monkeypatch.setattr(kq, "_num_sms", lambda index: 132)
    resident = paged_attention.resident_ctas(168, 0)
    assert resident == 132 * 12  # 168 registers: 12 one-warp CTAs per SM
    for batch, context in ((16, 4096), (64, 16384), (1, 512), (3, 1000)):
        splits, per_split = paged_attention.split_plan(batch, 32, 8, context, resident)
        assert per_split % paged_attention.TILE_TOKENS == 0 and splits * per_split >= context
        assert (splits - 1) * per_split < context  # no empty split
        ctas = batch * 8 * splits
        if ctas > resident:  # several waves: the last one is mostly full
            assert ctas % resident == 0 or ctas % resident > resident // 2, (batch, context, splits)
    assert paged_attention.split_plan(16, 32, 8, 4096, resident) == (12, 352)  # one full wave of 1536 CTAs
    assert paged_attention.split_plan(1, 32, 8, 4096, resident, tokens_per_split=1 << 20)[0] == 1
    # one stream at a 1024-token graph bound: 32 splits of two 16-token tiles (2 KV heads: 64 CTAs)
    assert paged_attention.split_plan(1, 16, 2, 1024, resident) == (32, 32)
    # a 4M-token context (16 waves of CTAs) stays within the reduce's shared memory (a weight per split)
    assert paged_attention.split_plan(1, 16, 2, 1 << 22, resident)[0] == paged_attention.MAX_SPLITS
    # 2048 single-token queries (a graphed prefill step) at a 4096 bound: 16 waves, not 41
    assert paged_attention.split_plan(2048, 16, 2, 4096, resident) == (6, 688)
    assert [kq.default_tile("ksplit", m) for m in (1, 8, 9, 16, 17)] == [1, 1, 2, 2, 2]
    assert [kq.default_tile("gemv", m) for m in (1, 2, 3, 4)] == [1, 2, 4, 4]
    assert [kq.default_tile("stream", m) for m in (1, 2, 3, 4)] == [1, 2, 4, 4]
    assert [kq.default_tile("staged", m) for m in (1, 8, 9, 16, 17, 33, 64)] == [1, 1, 2, 2, 4, 8, 8]
    # staged splits: about one CTA per SM, fp32 partials never above a quarter of the weight bytes
    assert kq._split_plan(32, 32, 64, 4096, 0, None) == (4, 8)  # 4096x4096, 64 tokens: 32 row tiles x 4
    assert kq._split_plan(16, 16, 64, 2048, 0, None) == (2, 8)  # 2048x2048, 64 tokens: capped by the partials
    assert kq._split_plan(16, 16, 8, 2048, 0, None) == (8, 2)
    assert kq._split_plan(5, 1, 8, 576, 0, 3) == (3, 2)  # 5 segments over 3 requested splits: 2, 2, 1


def test_an_explicit_tc_kernel_refuses_weights_it_cannot_take():
    from deepinfer.kernels import quant_matmul as kq

    packed = quantize_rtn(torch.randn(48, 256), bits=3, group_size=128)  # tc and tcs take W4 only
    for kernel in ("tc", "tcs"):
        with pytest.raises(ValueError, match=f"the {kernel} kernel does not take"):
            kq.quant_matmul(torch.randn(1, 256, dtype=torch.float16), packed.qweight, packed.scales, packed.zeros, 3,
                            128, "zero", kernel=kernel)


def test_products_go_to_the_path_measured_fastest_for_their_token_count_and_shape():
    from deepinfer.core.ops.quant_matmul_table import ProductShape, product_row

    # (tokens, in, out) -> path, as docs/KERNELS.md's product table gives it with its results files (Qwen2.5-3B's
    # merged shapes, W4 G128)
    expected = {(1, 2048, 2560): "tc", (1, 2048, 22016): "tcs", (1, 11008, 2048): "tc", (2, 2048, 2560): "tc",
                (4, 2048, 22016): "tcs", (8, 2048, 2048): "tc", (9, 2048, 2048): "fragment",
                (16, 2048, 22016): "fragment", (16, 11008, 2048): "fragment", (24, 2048, 2560): "w4_gemm",
                (17, 2048, 22016): "fragment", (17, 11008, 2048): "w4_gemm", (17, 2048, 2560): "w4_gemm",
                (32, 11008, 2048): "w4_gemm", (32, 2048, 22016): "fragment", (32, 2048, 2048): "ksplit",
                (33, 2048, 2560): "w4_gemm", (48, 11008, 2048): "w4_gemm", (48, 2048, 22016): "fragment_batch",
                (64, 2048, 2048): "dense", (64, 2048, 2560): "w4_gemm", (65, 2048, 2560): "dense",
                (9, 11008, 2048): "fragment", (9, 2048, 22016): "fragment", (16, 3584, 4608): "fragment",
                (1, 18944, 3584): "fragment", (8, 3584, 37888): "fragment", (32, 18944, 3584): "fragment",
                (8, 3584, 4608): "tc", (24, 576, 3072): "staged", (65, 576, 3072): "w4_gemm",
                (65, 2048, 22016): "fragment_batch",
                (128, 11008, 2048): "w4_gemm", (129, 2048, 22016): "dense", (100, 2048, 2560): "dense",
                (2048, 2048, 2048): "dense"}
    for (tokens, k, n), path in expected.items():
        assert product_row(ProductShape(tokens, k, n, 4, 128)).kernel == path, (tokens, k, n)
    # weights the tc kernel does not take keep the CUDA-core and mma kernels
    untaken = {(1, 2048, 2560, 3, 128): "gemv", (1, 11008, 2048, 3, 128): "stream", (8, 2048, 2048, 3, 128): "ksplit",
               (1, 11008, 1000, 4, 128): "stream", (4, 2016, 2048, 4, 32): "ksplit", (24, 2048, 2048, 4, 96): "ksplit",
               (24, 11008, 2048, 4, 96): "w4_gemm", (12, 3584, 3584, 3, 128): "ksplit",
               (24, 2048, 11008, 3, 128): "staged", (64, 2048, 11008, 3, 128): "staged",
               (100, 2048, 11008, 3, 128): "dense"}
    for (tokens, k, n, bits, group), path in untaken.items():
        assert product_row(ProductShape(tokens, k, n, bits, group)).kernel == path, (tokens, k, n, bits, group)


def test_a_product_tables_row_serves_the_shapes_it_names_and_launches_its_kernel(monkeypatch):
    """A row added before the others takes the shapes it serves, through its own launcher, and only those: the
    table is the one place a product's kernel is chosen."""
    from deepinfer.core.ops import quant_matmul_table as table
    from deepinfer.core.ops.quant_matmul import quant_matmul

    launched = []
    row = table.ProductRow("w4_gemm", lambda s: 9 <= s.tokens <= 256 and s.bits == 4,
                           lambda rows, packed: launched.append(rows.shape[0]) or rows.new_zeros(rows.shape[0], 48),
                           "a test row")
    monkeypatch.setattr(table, "PRODUCT_TABLE", (row, *table.PRODUCT_TABLE))
    monkeypatch.setattr(dispatch, "kernel_blocker", lambda devices: None)
    table.product_row.cache_clear()
    try:
        assert [table.product_row(table.ProductShape(m, 2048, 2048, 4, 128)).kernel for m in (8, 9, 256, 257)] == [
            "tc", "w4_gemm", "w4_gemm", "dense"]
        packed = quantize_rtn(torch.randn(48, 64), bits=4, group_size=32)
        with torch.no_grad():
            out = quant_matmul(torch.randn(2, 6, 64, dtype=torch.float16), packed)  # 12 tokens
        assert launched == [12] and out.shape == (2, 6, 48)
    finally:
        table.product_row.cache_clear()


def _kernel_parameters(source: str, template: str) -> list[str]:
    """C types of a kernel's parameters, read from its source: 'ptr', 'int', 'i64' or 'float'."""
    from deepinfer.kernels.compiler import source_text

    text = source_text(source)
    match = re.search(rf"__global__ void (?:__launch_bounds__\([^)]+\) )?{template}\((.*?)\)\s*{{", text, re.DOTALL)
    kinds = []
    for param in re.sub(r"//[^\n]*", "", match.group(1)).split(","):
        param = param.strip()
        kinds.append("ptr" if "*" in param else param.split()[0])
    return kinds


_ARG_KIND = {np.uint64: "ptr", np.int32: "int", np.int64: "i64", np.float32: "float"}


def test_launchers_pass_exactly_the_kernel_parameter_types(monkeypatch):
    """Every launcher's argument list matches its kernel's C signature, in count and exact type; and every kernel
    of the sources has a launcher (no kernel is left in a .cu file that nothing launches)."""
    from deepinfer.kernels import act_and_mul as ka
    from deepinfer.kernels import paged_attention as kp
    from deepinfer.kernels import quant_matmul as kq
    from deepinfer.kernels import rms_norm as kr
    from deepinfer.kernels import rope_cache as krc

    class _Kernel(tuple):  # (source, name), with the register count the split plan reads
        num_regs = 168

    launches = []
    for module in (ka, kp, kq, kr, krc):
        monkeypatch.setattr(module, "get_kernel", lambda source, name, index: _Kernel((source, name)))
        monkeypatch.setattr(module, "launch", lambda kernel, grid, block, args, index, shared_mem=0, cluster=None:
                            launches.append((kernel, args)))
    monkeypatch.setattr(kq, "_num_sms", lambda index: 132)
    monkeypatch.setattr(kp, "_device_limits", lambda index: (132, 2048, 65536, 32))
    monkeypatch.setattr(kq, "_counters", {None: torch.zeros(8, dtype=torch.int32)})
    monkeypatch.setattr(kq, "_plans", {})
    monkeypatch.setattr(kq, "_workspaces", {})
    half = torch.float16
    packed = quantize_rtn(torch.randn(256, 512), bits=4, group_size=128)
    for kernel in kq.KERNELS:
        kq.quant_matmul(torch.randn(3, 512, dtype=half), packed.qweight, packed.scales, packed.zeros, 4, 128, "zero",
                        kernel=kernel)
    monkeypatch.setattr(kp, "clusters_available", lambda index: True)
    cache = torch.zeros(40, 2, 16, 64, dtype=half)
    for path in kp.DECODE_PATHS:  # split (decode + reduce), combined, clustered
        for heads in (8, 18):  # 4 query heads a KV head: the heads-as-n kernel; 9: the other one
            kp.paged_decode_attention(torch.randn(2, heads, 64, dtype=half), cache, cache,
                                      torch.zeros(2, 20, dtype=torch.int32), torch.tensor([300, 5], dtype=torch.int32),
                                      300, 0.125, path=path, pipelined=True)
    for bound in (20, 4096):  # one key split; several, and their reduce
        kp.paged_prefill_attention(torch.randn(20, 8, 64, dtype=half), cache, cache,
                                   torch.zeros(20, 20, dtype=torch.int32), torch.arange(1, 21, dtype=torch.int32),
                                   torch.tensor([[0, 16], [16, 4]], dtype=torch.int32), bound, 0.125, 64, 30.0)
    codes, code_scales = torch.zeros(40, 2, 16, 64, dtype=torch.int8), torch.ones(40, 2, 16, dtype=half)
    kp.paged_prefill_attention(torch.randn(20, 8, 64, dtype=half), codes, codes, torch.zeros(20, 20, dtype=torch.int32),
                               torch.arange(1, 21, dtype=torch.int32), torch.tensor([[0, 16]], dtype=torch.int32), 20,
                               0.125, key_scales=code_scales, value_scales=code_scales)
    kr.rms_norm(torch.randn(2, 64, dtype=half), torch.randn(64, dtype=half), 1e-6, 1.0, torch.randn(2, 64, dtype=half))
    ka.act_and_mul(torch.randn(2, 64, dtype=half), torch.randn(2, 64, dtype=half), "silu")
    krc.rope_and_cache_write(torch.randn(3, 8, 64, dtype=half), torch.randn(3, 2, 64, dtype=half),
                             torch.randn(3, 2, 64, dtype=half), torch.randn(3, 32, dtype=half),
                             torch.randn(3, 32, dtype=half), cache, cache, torch.tensor([0, 5, 9]))
    qkv = quantize_rtn(torch.randn((8 + 2 * 2) * 64, 512), bits=4, group_size=128)  # 8 q + 2 k + 2 v heads of 64
    kq.quant_matmul_rope_cache(torch.randn(3, 512, dtype=half), qkv.qweight, qkv.scales, qkv.zeros, None, 128, "zero",
                               qkv.integer_zeros, 8, 2, 64, torch.randn(3, 32, dtype=half),
                               torch.randn(3, 32, dtype=half), cache, cache, torch.tensor([0, 5, 9]))
    gate_up = quantize_rtn(torch.randn(2 * 768, 512), bits=4, group_size=128)  # [gate | up], I = 768
    monkeypatch.setattr(kq, "clusters_available", lambda index: True)
    for cluster_splits in (False, True):  # two K splits: through global memory, or a cluster
        kq.quant_matmul_act_and_mul(torch.randn(3, 512, dtype=half), gate_up.qweight, gate_up.scales, gate_up.zeros,
                                    None, 128, "zero", gate_up.integer_zeros, "silu", cluster_splits=cluster_splits)
    from deepinfer.kernels import dequantize as kd

    monkeypatch.setattr(kd, "get_kernel", lambda source, name, index: _Kernel((source, name)))
    monkeypatch.setattr(kd, "launch", lambda kernel, grid, block, args, index: launches.append((kernel, args)))
    kd.dequantize(packed.qweight, packed.scales, packed.zeros, 4, 128, "zero", half)
    from deepinfer.kernels import w4_gemm as kw

    monkeypatch.setattr(kw, "get_kernel", lambda source, name, index: _Kernel((source, name)))
    monkeypatch.setattr(kw, "launch", lambda kernel, grid, block, args, index, shared_mem=0:
                        launches.append((kernel, args)))
    monkeypatch.setattr(kw, "_allow_shared_memory", lambda fn, shared_bytes, index: None)
    monkeypatch.setattr(kw, "_num_sms", lambda index: 132)
    monkeypatch.setattr(kw, "_max_shared_bytes", lambda index: 232448)
    monkeypatch.setattr(kw, "split_k_buffers", lambda device, splits, tiles, tile_outputs:
                        (torch.zeros(1), torch.zeros(8, dtype=torch.int32)) if splits > 1 else (None, None))
    sz, zmode = kw.gemm_scales(packed.scales, packed.zeros, "zero", half)
    for wgmma in (False, True):
        monkeypatch.setattr(kw, "wgmma_available", lambda index, wgmma=wgmma: wgmma)
        kw.w4_gemm(torch.randn(100, 512, dtype=half), packed.qweight, sz, zmode, 128, bias=torch.randn(256, dtype=half))
    from deepinfer.kernels import w4_fragment_gemm as kf

    monkeypatch.setattr(kf, "get_kernel", lambda source, name, index: _Kernel((source, name)))
    monkeypatch.setattr(kf, "launch", lambda kernel, grid, block, args, index, shared_mem=0:
                        launches.append((kernel, args)))
    monkeypatch.setattr(kf, "_num_sms", lambda index: 132)
    monkeypatch.setattr(kf, "split_k_buffers", lambda device, splits, tiles, tile_outputs:
                        (torch.zeros(1), torch.zeros(8, dtype=torch.int32)) if splits > 1 else (None, None))
    monkeypatch.setattr(kf, "_allow_shared_memory", lambda fn, shared_bytes, index: None)
    fragment_weight = kf.fragment_layout(packed.qweight, packed.scales, packed.zeros, 128, 256, 512, half)
    kf.w4_fragment_gemm(torch.randn(5, 512, dtype=half), fragment_weight, bias=torch.randn(256, dtype=half))
    gate_up_weight = kf.gate_up_layout(packed.qweight, packed.scales, packed.zeros, 128, 512, half)
    kf.w4_fragment_gemm_act_and_mul(torch.randn(40, 512, dtype=half), gate_up_weight, "silu",
                                    bias=torch.randn(256, dtype=half))
    from deepinfer.kernels import w8_gemm as kw8

    monkeypatch.setattr(kw8, "get_kernel", lambda source, name, index: _Kernel((source, name)))
    monkeypatch.setattr(kw8, "launch", lambda kernel, grid, block, args, index, cluster=None:
                        launches.append((kernel, args)))
    monkeypatch.setattr(kw8, "_num_sms", lambda index: 132)
    monkeypatch.setattr(kw8, "clusters_available", lambda index: True)
    eight = quantize_rtn(torch.randn(256, 512), bits=8, group_size=32)
    kw8.w8_gemm(torch.randn(5, 512, dtype=half), eight.qweight, eight.scales, eight.zeros, 32, eight.zero_mode,
                eight.integer_zeros, bias=torch.randn(256, dtype=half))
    monkeypatch.setattr(kw, "wgmma_available", lambda index: True)
    kw8.w8_gemm(torch.randn(40, 512, dtype=half), eight.qweight, eight.scales, eight.zeros, 32, eight.zero_mode,
                eight.integer_zeros, bias=torch.randn(256, dtype=half), wgmma=True)
    from deepinfer.kernels import w4_fragment_batch as kfb

    monkeypatch.setattr(kfb, "get_kernel", lambda source, name, index: _Kernel((source, name)))
    monkeypatch.setattr(kfb, "launch", lambda kernel, grid, block, args, index, shared_mem=0:
                        launches.append((kernel, args)))
    monkeypatch.setattr(kfb, "_num_sms", lambda index: 132)
    monkeypatch.setattr(kfb, "split_k_buffers", lambda device, splits, tiles, tile_outputs:
                        (torch.zeros(1), torch.zeros(8, dtype=torch.int32)))
    monkeypatch.setattr(kfb, "_allow_shared_memory", lambda fn, shared_bytes, index: None)
    for wgmma in (False, True):
        monkeypatch.setattr(kfb, "wgmma_available", lambda index, wgmma=wgmma: wgmma)
        kfb.w4_fragment_batch(torch.randn(70, 512, dtype=half), fragment_weight, bias=torch.randn(256, dtype=half))
    from deepinfer.kernels import token_bitmask as kt

    monkeypatch.setattr(kt, "get_kernel", lambda source, name, index: _Kernel((source, name)))
    monkeypatch.setattr(kt, "launch", lambda kernel, grid, block, args, index: launches.append((kernel, args)))
    kt.apply_token_bitmask_(torch.randn(4, 70), torch.tensor([2, 0], dtype=torch.int32),
                            torch.zeros(2, 3, dtype=torch.int32))
    names = {name.split("<")[0] for (_, name), _ in launches}
    assert names == {"quant_tc_gemv_kernel", "quant_tc_rope_kernel", "quant_tcs_kernel", "quant_tcs_act_kernel",
                     "quant_gemv_kernel", "quant_stream_kernel", "quant_mma_ksplit_kernel", "quant_mma_staged_kernel",
                     "paged_decode_kernel", "paged_decode_heads_n_kernel", "paged_reduce_kernel", "paged_prefill_kernel",
                     "paged_prefill_reduce_kernel",
                     "rms_norm_kernel", "act_and_mul_kernel", "rope_cache_kernel", "dequantize_kernel",
                     "w4_gemm_kernel", "w4_fragment_gemm_kernel", "w8_gemm_kernel", "w8_wgmma_kernel",
                     "w4_fragment_batch_kernel",
                     "token_bitmask_kernel"}
    from deepinfer.kernels.compiler import SOURCE_DIR, source_text

    in_sources = {name for path in SOURCE_DIR.glob("*.cu") for name in
                  re.findall(r"__global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(", source_text(path.name))}
    assert in_sources == names
    for (source, name), args in launches:
        assert [_ARG_KIND[type(arg)] for arg in args] == _kernel_parameters(source, name.split("<")[0]), name


def test_qkv_rope_fusion_serves_decode_products_of_w4_merged_projections_only():
    """Where the q/k/v product takes RoPE and the cache write into its epilogue: a W4 weight tc takes, heads that
    tile into rotation pairs, a cache in the activations' dtype, int8 or e4m3, and the token counts tc serves up to
    one tile."""
    from deepinfer.core.ops.quant_matmul_table import QKV_ROPE, ProductShape, epilogue_serves, product_row
    from deepinfer.kernels import quant_matmul as kq

    bf16, int8 = torch.bfloat16, torch.int8
    qwen_3b = (16 + 2 * 2) * 128  # Qwen2.5-3B's merged q/k/v outputs, K = 2048
    assert kq.qkv_rope_unsupported_reason(4, 128, 2048, qwen_3b, 16, 2, 128, bf16, 16, bf16) is None
    assert [epilogue_serves(QKV_ROPE, ProductShape(m, 2048, 2560, 4, 128)) for m in (0, 1, 4, 8, 9, 32)] == [
        False, True, True, True, False, False]
    for quantized in (int8, torch.float8_e4m3fn):  # codes and scales stored by the epilogue too
        assert kq.qkv_rope_unsupported_reason(4, 128, 2048, qwen_3b, 16, 2, 128, quantized, 16, bf16) is None
    assert "float16" in kq.qkv_rope_unsupported_reason(4, 128, 2048, qwen_3b, 16, 2, 128, torch.float16, 16, bf16)
    wide_heads = (8 + 2 * 4) * 272  # an int8 row's amax is one warp's: at most 256 elements a head
    assert kq.qkv_rope_unsupported_reason(4, 128, 2048, wide_heads, 8, 4, 272, bf16, 16, bf16) is None
    assert "head_dim 272" in kq.qkv_rope_unsupported_reason(4, 128, 2048, wide_heads, 8, 4, 272, int8, 16, bf16)
    assert "3-bit" in kq.qkv_rope_unsupported_reason(3, 128, 2048, qwen_3b, 16, 2, 128, bf16, 16, bf16)
    assert "heads" in kq.qkv_rope_unsupported_reason(4, 128, 2048, qwen_3b, 16, 4, 128, bf16, 16, bf16)
    assert "power of two" in kq.qkv_rope_unsupported_reason(4, 128, 2048, qwen_3b, 16, 2, 128, bf16, 24, bf16)
    odd_heads = (8 + 2 * 4) * 72  # 1152 rows: whole tc tiles
    assert "head_dim 72" in kq.qkv_rope_unsupported_reason(4, 128, 2048, odd_heads, 8, 4, 72, bf16, 16, bf16)
    smollm = (9 + 2 * 3) * 64  # K = 576: not whole 128-code segments
    assert "tc kernel" in kq.qkv_rope_unsupported_reason(4, 64, 576, smollm, 9, 3, 64, bf16, 16, bf16)
    # past one token tile the fused kernel never serves: a large long-K q/k/v product goes to the fragment kernel there
    assert product_row(ProductShape(12, 4096, 6144, 4, 128)).kernel == "fragment"
    assert not epilogue_serves(QKV_ROPE, ProductShape(12, 4096, 6144, 4, 128))
    # a W3 weight: the plain product is not on tc, so the fusion never serves
    assert not epilogue_serves(QKV_ROPE, ProductShape(1, 2048, 2560, 3, 128))


def test_gate_up_activation_fusion_serves_the_products_tcs_takes_only():
    """Where the gate/up product takes the activation into its epilogue: a W4 weight tcs takes (whole 16-row tiles
    in each half), an activation the act_and_mul kernel has, and the token counts dispatch gives tcs (1-8 here;
    from 9 the fragment kernel serves the product and the activation runs apart)."""
    from deepinfer.core.ops.quant_matmul_table import GATE_UP_ACT, ProductShape, epilogue_serves, product_row
    from deepinfer.kernels import quant_matmul as kq

    qwen_3b = 2 * 11008  # Qwen2.5-3B's merged gate/up outputs, K = 2048
    assert kq.gate_up_act_unsupported_reason(4, 128, 2048, qwen_3b, "silu") is None
    assert kq.gate_up_act_unsupported_reason(4, 128, 2048, qwen_3b, "gelu_tanh") is None
    assert [epilogue_serves(GATE_UP_ACT, ProductShape(m, 2048, 22016, 4, 128)) for m in (0, 1, 8, 9, 16, 17, 33)] == [
        False, True, True, False, False, False, False]
    assert "activation 'gelu'" in kq.gate_up_act_unsupported_reason(4, 128, 2048, qwen_3b, "gelu")
    assert "3-bit" in kq.gate_up_act_unsupported_reason(3, 128, 2048, qwen_3b, "silu")
    assert "two halves" in kq.gate_up_act_unsupported_reason(4, 128, 2048, 1040, "silu")  # halves of 520 rows
    assert "tcs kernel" in kq.gate_up_act_unsupported_reason(4, 64, 576, 2 * 1536, "silu")  # K = 576
    # a narrow merged MLP (2I < 3K) goes to tc, not tcs: the separate ops serve it
    assert product_row(ProductShape(1, 4096, 4096, 4, 128)).kernel == "tc"
    assert not epilogue_serves(GATE_UP_ACT, ProductShape(1, 4096, 4096, 4, 128))


@pytest.mark.parametrize("clusters", [True, False])
def test_gate_up_products_k_splits_meet_in_a_cluster_where_the_device_has_clusters(monkeypatch, clusters):
    """At 1-8 tokens the fused gate/up product splits K in two (few row tiles); on SM90+ the two splits of a tile are
    one thread-block cluster (no partials, no counters), elsewhere they meet through fp32 partials in global
    memory. From 9 tokens there is one split and no cluster."""
    from deepinfer.kernels import quant_matmul as kq

    launches = []
    monkeypatch.setattr(kq, "get_kernel", lambda source, name, index: name)
    monkeypatch.setattr(kq, "launch", lambda kernel, grid, block, args, index, shared_mem=0, cluster=None:
                        launches.append((kernel, grid, args, cluster)))
    monkeypatch.setattr(kq, "_num_sms", lambda index: 132)
    monkeypatch.setattr(kq, "clusters_available", lambda index: clusters)
    monkeypatch.setattr(kq, "_counters", {None: torch.zeros(8, dtype=torch.int32)})
    monkeypatch.setattr(kq, "_workspaces", {})
    gate_up = quantize_rtn(torch.randn(2 * 11008, 512), bits=4, group_size=128)  # Qwen2.5-3B's inner size
    for tokens in (1, 12):
        kq.quant_matmul_act_and_mul(torch.randn(tokens, 512, dtype=torch.float16), gate_up.qweight, gate_up.scales,
                                    gate_up.zeros, None, 128, "zero", gate_up.integer_zeros, "silu")
    (one_name, one_grid, one_args, one_cluster), (twelve_name, twelve_grid, twelve_args, twelve_cluster) = launches
    assert one_grid == (172, 1, 2) and twelve_grid == (172, 1, 1)  # 11008 / 64 row tiles; two K splits at one token
    partials, counters = int(one_args[6]), int(one_args[7])
    if clusters:
        assert one_name == "quant_tcs_act_kernel<0,1,0,0,0,1>" and one_cluster == (1, 1, 2)
        assert partials == counters == 0
    else:
        assert one_name == "quant_tcs_act_kernel<0,1,0,0,0>" and one_cluster is None
        assert partials != 0 and counters != 0
    assert twelve_name == "quant_tcs_act_kernel<0,2,0,0,0>" and twelve_cluster is None and int(twelve_args[6]) == 0
    with pytest.raises(ValueError, match="cluster_splits needs 2-8 K splits"):
        kq.quant_matmul_act_and_mul(torch.randn(12, 512, dtype=torch.float16), gate_up.qweight, gate_up.scales,
                                    gate_up.zeros, None, 128, "zero", gate_up.integer_zeros, "silu",
                                    cluster_splits=True)


def test_gate_up_act_and_mul_leaves_cpu_and_unquantized_layers_to_the_unfused_ops(caplog):
    from deepinfer.core.ops import dispatch
    from deepinfer.core.ops.gate_up_activation import gate_up_act_and_mul

    dispatch.reset_log()
    caplog.set_level(logging.INFO, logger="deepinfer.ops")
    assert gate_up_act_and_mul(torch.randn(1, 512), None, "silu") is None  # an unquantized projection
    packed = quantize_rtn(torch.randn(2 * 1024, 512), bits=4, group_size=128)
    assert gate_up_act_and_mul(torch.randn(1, 512), packed, "silu") is None  # on the CPU
    assert gate_up_act_and_mul(torch.randn(40, 512), packed, "silu") is None  # 40 tokens: not tcs, nothing logged
    messages = [r.getMessage() for r in caplog.records if r.name == "deepinfer.ops"]
    assert messages == ["quant_matmul_act_and_mul: separate ops (tensors are not on a CUDA device)"]


def test_qkv_rotary_and_cache_write_leaves_cpu_and_unquantized_layers_to_the_unfused_ops(caplog):
    from deepinfer.core.ops import dispatch
    from deepinfer.core.ops.qkv_rotary import qkv_rotary_and_cache_write

    dispatch.reset_log()
    caplog.set_level(logging.INFO, logger="deepinfer.ops")

    cache = torch.zeros(4, 2, 16, 128)
    cos = sin = torch.zeros(1, 64)
    assert qkv_rotary_and_cache_write(torch.randn(1, 512), None, 4, 2, 128, cos, sin, cache, cache,
                                      torch.tensor([3])) is None  # an unquantized projection
    packed = quantize_rtn(torch.randn((4 + 2 * 2) * 128, 512), bits=4, group_size=128)
    assert qkv_rotary_and_cache_write(torch.randn(1, 512), packed, 4, 2, 128, cos, sin, cache, cache,
                                      torch.tensor([3])) is None  # on the CPU
    messages = [r.getMessage() for r in caplog.records if r.name == "deepinfer.ops"]
    assert messages == ["quant_matmul_rope_cache: separate ops (tensors are not on a CUDA device)"]


def test_dispatch_decisions_are_keyed_by_everything_their_checks_read(monkeypatch):
    """A check sees only its op's case (a NamedTuple built from the tensors), so two calls that differ in anything
    the check reads have different cases: an unaligned gate after an aligned one of the same shape is not served
    from the aligned one's cached decision; and a check that closes over a tensor is refused outright."""
    from deepinfer.core.ops.activation import ActCase, act_and_mul
    from deepinfer.kernels import act_and_mul as ka

    monkeypatch.setattr(dispatch, "kernel_blocker", lambda devices: None)
    served = []
    monkeypatch.setattr(ka, "act_and_mul", lambda gate, up, activation: served.append(True) or gate)
    gate, up = torch.zeros(3, 64, dtype=torch.float16), torch.zeros(3, 64, dtype=torch.float16)
    unaligned = torch.zeros(3 * 64 + 8, dtype=torch.float16)[1:1 + 3 * 64].view(3, 64)
    with torch.no_grad():
        act_and_mul(gate, up, "silu")
        act_and_mul(unaligned, up, "silu")
    assert served == [True]
    assert ActCase.of(gate, up, "silu") != ActCase.of(unaligned, up, "silu")
    with pytest.raises(TypeError, match="reads only its case"):
        dispatch.decide("some_op", ActCase.of(gate, up, "silu"), lambda case: None if gate.dim() == 2 else "no")
