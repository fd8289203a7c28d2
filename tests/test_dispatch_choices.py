"""Which kernel serves which case: a grid of cases through the core/ops entry points (and the engine's
tile and graph thresholds) on the CPU, with the CUDA checks passed and every launcher and torch reference
replaced by a recorder, against tests/dispatch_choices.json.

The JSON holds the choices the dispatch policy makes (W4/W3/W8 products per token count, shape, bits,
group size and dtype; the fused q/k/v + RoPE and gate/up + activation epilogues; the paged decode
attention's path per batch and context bound; the prefill tile size and the CUDA-graph buckets that tile;
the small ops' kernel-or-reference choice). A refactor of the dispatch must leave every entry as it is; a
deliberate, measured change of policy rewrites the entries it changes, in the same commit as the measurement.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

CHOICES = json.loads((Path(__file__).parent / "dispatch_choices.json").read_text())
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class Chosen(Exception):
    """Raised by a faked launcher or reference: the path the op took."""


def _expand(runs: str) -> list[str]:
    """'tc*6 ksplit*2' -> ['tc'] * 6 + ['ksplit'] * 2"""
    out = []
    for run in runs.split():
        choice, count = run.rsplit("*", 1)
        out += [choice] * int(count)
    return out


def _raise(choice: str):
    def record(*args, **kwargs):
        raise Chosen(choice)
    return record


@pytest.fixture
def recorded(monkeypatch):
    """Kernels pass their CUDA checks on CPU tensors (of a 132-SM SM90 device); each launcher and reference raises
    Chosen(path), the launchers with the kernel or path core/ops chose for them."""
    from deepinfer.core.ops import (
        activation,
        dispatch,
        gate_up_activation,
        norm,
        paged_attention,
        quant_matmul,
        quant_matmul_table,
        rotary,
    )
    from deepinfer.core.ops import paged_attention_table as attention_table
    from deepinfer.kernels import act_and_mul as ka
    from deepinfer.kernels import dequantize as kd
    from deepinfer.kernels import paged_attention as kp
    from deepinfer.kernels import quant_matmul as kq
    from deepinfer.kernels import rms_norm as kr
    from deepinfer.kernels import rope_cache as krc
    from deepinfer.kernels import w4_fragment_batch as kfb
    from deepinfer.kernels import w4_fragment_gemm as kf
    from deepinfer.kernels import w4_gemm as kw
    from deepinfer.kernels import w8_gemm as kw8

    monkeypatch.setattr(dispatch, "kernel_blocker", lambda devices: None)
    monkeypatch.setattr(kp, "multiprocessors", lambda index: 132)
    monkeypatch.setattr(kw, "wgmma_available", lambda index: True)  # an SM90 device, as the table was measured on
    clusters = {"available": False}
    monkeypatch.setattr(paged_attention, "clusters_available", lambda index: clusters["available"])

    def chosen_kernel(*args, kernel, **kwargs):
        raise Chosen(kernel)

    def chosen_path(*args, path, **kwargs):
        raise Chosen(path)

    for module, name, launcher in (
            (kq, "quant_matmul", chosen_kernel), (kd, "dequantize", _raise("dense")), (kw, "w4_gemm", _raise("w4_gemm")),
            (kw8, "w8_gemm", _raise("w8_gemm")),
            (kf, "w4_fragment_gemm", _raise("fragment")), (quant_matmul_table, "fragment_weight", lambda *args: ()),
            (kfb, "w4_fragment_batch", _raise("fragment_batch")),
            (kf, "w4_fragment_gemm_act_and_mul", _raise("fused")),
            (gate_up_activation, "gate_up_fragment_weight", lambda *args: ((), None)),
            (kq, "quant_matmul_rope_cache", _raise("fused")), (kq, "quant_matmul_act_and_mul", _raise("fused")),
            (kp, "paged_decode_attention", chosen_path), (kp, "paged_prefill_attention", _raise("prefill")),
            (kr, "rms_norm", _raise("kernel")), (ka, "act_and_mul", _raise("kernel")),
            (krc, "rope_and_cache_write", _raise("kernel"))):
        monkeypatch.setattr(module, name, launcher)
    # the tensors are on the CPU, whose product (quant_matmul_cpu) stands where a CUDA tensor would get the reference
    for module, name in ((quant_matmul, "quant_matmul_reference"), (quant_matmul, "quant_matmul_cpu"),
                         (paged_attention, "paged_decode_attention_reference"),
                         (paged_attention, "paged_prefill_attention_reference"), (norm, "rms_norm_reference"),
                         (activation, "act_and_mul_reference"), (rotary, "apply_rotary_reference"),
                         (rotary, "write_kv_cache_reference")):
        monkeypatch.setattr(module, name, _raise("reference"))
    dispatch.reset_log()
    quant_matmul_table.product_row.cache_clear()
    attention_table.decode_path.cache_clear()
    yield clusters
    dispatch.reset_log()


def _path(op, *args, **kwargs) -> str | None:
    """The path op(*args, **kwargs) takes (None: it returned without a kernel or reference, i.e. a fused op
    left the case to the separate ops)."""
    try:
        with torch.no_grad():
            op(*args, **kwargs)
    except Chosen as chosen:
        return chosen.args[0]
    return None


@functools.cache
def _packed(in_features: int, out_features: int, bits: int, group) -> object:
    """A PackedWeight of this shape (contents irrelevant: only the choice is recorded), shared by the cases."""
    from deepinfer.core.quant.packed import PackedWeight

    group_size = in_features if group == "K" else group
    groups = in_features // group_size
    return PackedWeight(torch.empty(out_features, in_features * bits // 32, dtype=torch.int32),
                        torch.ones(out_features, groups, dtype=torch.float16),
                        torch.zeros(out_features, groups, dtype=torch.float16), bits, group_size, in_features,
                        out_features)


def _activations(section: dict, features: int, dtype: str) -> torch.Tensor:
    """[most tokens, features]: each case takes its first rows (a view, as a step's rows are)."""
    return torch.empty(max(section["tokens"]), features, dtype=DTYPES[dtype])


def test_products_take_the_recorded_kernel_at_every_token_count(recorded):
    from deepinfer.core.ops.quant_matmul import quant_matmul

    section = CHOICES["quant_matmul"]
    for k, n, bits, group, dtype, runs in section["rows"]:
        packed, x = _packed(k, n, bits, group), _activations(section, k, dtype)
        got = [_path(quant_matmul, x[:m], packed) for m in section["tokens"]]
        assert got == _expand(runs), (k, n, bits, group, dtype)


def test_the_fused_qkv_rope_epilogue_serves_the_recorded_cases(recorded):
    from deepinfer.core.ops.qkv_rotary import qkv_rotary_and_cache_write

    section = CHOICES["qkv_rope"]
    for k, heads, kv_heads, head_dim, bits, group, dtype, kv, block_size, runs in section["rows"]:
        packed = _packed(k, (heads + 2 * kv_heads) * head_dim, bits, group)
        cache = torch.zeros(4, kv_heads, block_size, head_dim, dtype=torch.int8 if kv == "int8" else DTYPES[dtype])
        x, cos = _activations(section, k, dtype), _activations(section, head_dim // 2, dtype)
        slots = torch.zeros(x.shape[0], dtype=torch.long)
        got = [_path(qkv_rotary_and_cache_write, x[:m], packed, heads, kv_heads, head_dim, cos[:m], cos[:m],
                     cache, cache, slots[:m]) or "separate"
               for m in section["tokens"]]
        assert got == _expand(runs), (k, heads, kv_heads, head_dim, bits, group, dtype, kv, block_size)


def test_the_fused_gate_up_activation_epilogue_serves_the_recorded_cases(recorded):
    from deepinfer.core.ops.gate_up_activation import gate_up_act_and_mul

    section = CHOICES["gate_up_act"]
    for k, inner, bits, group, activation, dtype, runs in section["rows"]:
        packed, x = _packed(k, 2 * inner, bits, group), _activations(section, k, dtype)
        got = [_path(gate_up_act_and_mul, x[:m], packed, activation) or "separate"
               for m in section["tokens"]]
        assert got == _expand(runs), (k, inner, bits, group, activation, dtype)


def test_decode_attention_takes_the_recorded_path(recorded):
    from deepinfer.core.ops.paged_attention import paged_decode_attention

    section = CHOICES["decode_attention"]
    for heads, kv_heads, head_dim, dtype, kv, block_size, clusters, runs in section["rows"]:
        recorded["available"] = clusters
        int8 = kv == "int8"
        cache = torch.zeros(4, kv_heads, block_size, head_dim, dtype=torch.int8 if int8 else DTYPES[dtype])
        scales = torch.ones(4, kv_heads, block_size, dtype=torch.float16) if int8 else None
        got = []
        for sequences in section["sequences"]:
            query = torch.zeros(sequences, heads, head_dim, dtype=DTYPES[dtype])
            tables, lengths = torch.zeros(sequences, 4, dtype=torch.int32), torch.ones(sequences, dtype=torch.int32)
            for bound in section["bounds"]:
                got.append(_path(paged_decode_attention, query, cache, cache, tables, lengths, 0.1, key_scales=scales,
                                 value_scales=scales, max_seq_len=bound))
        assert got == _expand(runs), (heads, kv_heads, head_dim, dtype, kv, block_size, clusters)


def test_prefill_tiles_and_graph_thresholds_are_the_recorded_ones(recorded):
    from deepinfer.core.engine.worker import backends, cuda_graphs
    from deepinfer.core.ops import paged_attention_table

    class Backend:
        def __init__(self, name):
            self.name = name

    for backend, heads, kv_heads, head_dim, dtype, kv, block_size, tile in CHOICES["prefill_tile_tokens"]["rows"]:
        kv_dtype = torch.int8 if kv == "int8" else DTYPES[dtype]
        got = backends.prefill_tile_tokens(Backend(backend), torch.device("cpu"), DTYPES[dtype], heads, kv_heads,
                                           head_dim, kv_dtype, block_size)
        assert got == tile, (backend, heads, kv_heads, head_dim, dtype, kv, block_size)
    section = CHOICES["graph_tiles"]
    for tile_tokens, max_rows, runs in section["rows"]:
        buffers = cuda_graphs.StaticStepBuffers.__new__(cuda_graphs.StaticStepBuffers)
        buffers.tile_tokens, buffers.max_rows = tile_tokens, max_rows
        assert [str(buffers.num_tiles(t)) for t in section["bucket_tokens"]] == _expand(runs), (tile_tokens, max_rows)
    for kv_heads, limit in CHOICES["graph_attention_work_limit"]["rows"]:
        assert paged_attention_table.graph_attention_work_limit(kv_heads) == limit


def test_small_ops_take_the_kernel_in_the_recorded_cases(recorded):
    from deepinfer.core.ops.activation import act_and_mul
    from deepinfer.core.ops.norm import rms_norm
    from deepinfer.core.ops.rotary import rotary_and_cache_write, write_kv_cache

    for dtype, weight_dtype, hidden, residual, path in CHOICES["rms_norm"]["rows"]:
        x = torch.zeros(3, hidden, dtype=DTYPES[dtype])
        assert _path(rms_norm, x, torch.zeros(hidden, dtype=DTYPES[weight_dtype]), 1e-6, 0.0,
                     torch.zeros_like(x) if residual else None) == path
    for dtype, inner, activation, layout, path in CHOICES["act_and_mul"]["rows"]:
        gate, up = torch.zeros(3, inner, dtype=DTYPES[dtype]), torch.zeros(3, inner, dtype=DTYPES[dtype])
        if layout == "merged":  # the two halves of one [T, 2I] product
            merged = torch.zeros(3, 2 * inner, dtype=DTYPES[dtype])
            gate, up = merged[:, :inner], merged[:, inner:]
        elif layout == "mismatch":
            up = up.to(torch.bfloat16 if dtype == "float16" else torch.float16)
        elif layout == "offset":  # rows one element off 16-byte alignment
            gate = torch.zeros(3 * inner + 8, dtype=DTYPES[dtype])[1:1 + 3 * inner].view(3, inner)
        try:
            got = _path(act_and_mul, gate, up, activation)
        except ValueError:
            got = "error"
        assert got == path, (dtype, inner, activation, layout)
    for section, op in (("rope_cache_write", "rope"), ("kv_cache_write", "write")):
        for dtype, kv, head_dim, block_size, path in CHOICES[section]["rows"]:
            other = torch.float32 if dtype != "float32" else torch.float16
            kv_dtype = {"int8": torch.int8, "same": DTYPES[dtype], "other": other}[kv]
            cache = torch.zeros(4, 2, block_size, head_dim, dtype=kv_dtype)
            scales = torch.ones(4, 2, block_size, dtype=torch.float16) if kv == "int8" else None
            query = torch.zeros(3, 4, head_dim, dtype=DTYPES[dtype])
            key, cos = torch.zeros(3, 2, head_dim, dtype=DTYPES[dtype]), torch.zeros(3, head_dim // 2, dtype=DTYPES[dtype])
            slots = torch.zeros(3, dtype=torch.long)
            if op == "rope":
                got = _path(rotary_and_cache_write, query, key, key, cos, cos, cache, cache, slots, scales, scales)
            else:
                got = _path(write_kv_cache, key, key, cache, cache, slots, scales, scales)
            assert got == path, (section, dtype, kv, head_dim, block_size)
