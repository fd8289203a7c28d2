"""The fragment layout of the few-token W4 kernel (kernels/w4_fragment_gemm.py) against the reference dequantizer.

`dequantize_fragments` reads the layout back the way w4_fragment_gemm.cu does (lane, k16 step, nibble i = 4e + p of
the word; the kernel's masks, shifts and magic exponents; the zero pair added in the activation dtype; the fp16 scale
in fp32). Its fp32 weight must equal core.quant.packing.dequantize(packed, float32) bit for bit: the products the
kernel's tensor cores see are then (q - z) exactly and its group scaling is the reference's fp32 multiply. Shapes
cover partial row tiles and K that is not a multiple of an atom (64), every group size the kernel takes and one
group a row. One hand-placed code pins the nibble mapping independently of both functions.
"""

from __future__ import annotations

import pytest
import torch
from w4_cases import random_w4_weight

from deepinfer.core.quant.packing import dequantize, pack_weight
from deepinfer.kernels import w4_fragment_gemm as fragment


def _layout(packed, dtype):
    return fragment.fragment_layout(packed.qweight, packed.scales, packed.zeros, packed.group_size,
                                    packed.out_features, packed.in_features, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_features,in_features,group_size", [
    (48, 256, 128),   # whole tiles and atoms
    (40, 160, 32),    # a partial last row tile, K not a multiple of 64
    (24, 192, 64),
    (16, 224, 224),   # one group a row (per-channel), K = 3.5 atoms
    (8, 512, 256),    # less than one row tile
])
def test_unpacked_fragments_equal_the_reference_dequantizer_bit_for_bit(dtype, out_features, in_features,
                                                                        group_size):
    packed = random_w4_weight(out_features, in_features, group_size, "zero", True, seed=out_features + in_features)
    weight = _layout(packed, dtype)
    tiles, atoms = -(-out_features // 16), -(-in_features // 64)
    assert weight.frag.shape == (tiles, atoms, 32, 4) and weight.frag.dtype == torch.int32
    assert weight.sz.shape == (tiles, in_features // group_size, 8, 2) and weight.sz.dtype == torch.int32
    unpacked = fragment.dequantize_fragments(weight, dtype)
    reference = dequantize(packed, torch.float32)
    assert torch.equal(unpacked.view(torch.int32), reference.view(torch.int32))


def test_one_code_lands_in_the_lane_word_and_nibble_the_mma_fragment_needs():
    """Row 25, k 70 of a 32 x 128 weight: row tile 1 (row 9 of it: g = 1, h = 1), atom 1, step 0, k 6 of the step
    (t = 3, e = 0, hk = 0): lane 4 g + t = 7, word 0, nibble 4 e + 2 hk + h = 1 (register a1, row g + 8)."""
    codes = torch.zeros(32, 128, dtype=torch.int64)
    codes[25, 70] = 11
    packed = pack_weight(codes, torch.ones(32, 1).half(), torch.zeros(32, 1).half(), 4)
    frag = fragment.fragment_codes(packed.qweight, 32, 128)
    expected = torch.zeros_like(frag)
    expected[1, 1, 7, 0] = 11 << 4
    assert torch.equal(frag, expected)


def test_padding_rows_get_zero_scales_and_codes():
    packed = random_w4_weight(20, 96, 32, "zero", True, seed=3)
    weight = _layout(packed, torch.bfloat16)
    scales = weight.sz[..., 0].to(torch.int64) & 0xFFFFFFFF  # [tiles, G, 8] fp16 pairs (row g, row g + 8)
    # tile 1 holds rows 16-19 (g < 4, low halves); rows 20-23 (g >= 4) and 24-31 (every high half) are padding
    assert bool((scales[1, :, :4] & 0xFFFF != 0).all()) and bool((scales[1, :, 4:] & 0xFFFF == 0).all())
    assert bool((scales[1] >> 16 == 0).all())
    k_pad = weight.frag[:, 1, :, 2:]  # atom 1 = k 64..127, steps 2-3 = k 96..127: past K
    assert bool((k_pad == 0).all())


def test_weights_the_kernel_does_not_take_say_why():
    assert fragment.fragment_reason(4, 128, 2048, "zero", True, torch.float16) is None
    assert fragment.fragment_reason(4, 2048, 2048, "zero", True, torch.float16) is None  # one group a row
    assert "3-bit" in fragment.fragment_reason(3, 128, 2048, "zero", True, torch.float16)
    assert "zero points" in fragment.fragment_reason(4, 128, 2048, "min", False, torch.float16)
    assert "zero points" in fragment.fragment_reason(4, 128, 2048, "zero", False, torch.float16)
    assert "scales" in fragment.fragment_reason(4, 128, 2048, "zero", True, torch.float32)
    assert "group size 96" in fragment.fragment_reason(4, 96, 2048, "zero", True, torch.float16)
    packed = random_w4_weight(16, 64, 32, "zero", True)
    with pytest.raises(ValueError, match="integer zero points"):
        fragment.fragment_scales(packed.scales, packed.zeros + 0.5, torch.bfloat16)


def test_plan_picks_a_launch_shape_it_compiles_and_splits_k_within_its_stages(monkeypatch):
    monkeypatch.setattr(fragment, "_num_sms", lambda index: 132)
    names = set(fragment.instantiations())
    for tokens in (1, 5, 8, 9, 16, 17, 32):
        for n, k in ((2560, 2048), (2048, 2048), (22016, 2048), (2048, 11008), (37888, 3584)):
            config, splits = fragment.plan(tokens, n, k, 0)
            assert config.tokens >= tokens
            for g in (32, 64, 128, k):
                assert config.name(1, config.group_steps(g, k)) in names
            assert 1 <= splits <= max(1, -(-k // config.bk) // 2)
            assert config.shared_bytes(2) <= 227 * 1024


def test_a_weight_that_keeps_one_form_or_has_float_zeros_runs_on_the_next_row(monkeypatch):
    """The fragment rows' launchers: a weight prepared without its fragment copy (a memory budget) or one the layout
    cannot hold (float zero points) goes to the row that would serve the shape without the fragment kernels, and so
    does the batch row's product on a GPU without the wgmma path it was measured on."""
    from deepinfer.core.ops import quant_matmul_table as table

    ran = []
    row = table.ProductRow("next", lambda shape: True, lambda rows, packed: ran.append(packed) or "next", "")
    monkeypatch.setattr(table, "_row_after_fragment", lambda shape: row)
    one_form = random_w4_weight(64, 256, 128, "zero", True)
    assert table.fragment_weight(one_form, torch.bfloat16, lay_out=False) is None
    assert table.fragment_weight(one_form, torch.bfloat16) is None  # the first decision stays
    float_zeros = random_w4_weight(64, 256, 128, "min", False)
    assert table.fragment_takes(one_form) and not table.fragment_takes(float_zeros)
    for packed in (one_form, float_zeros):
        assert table.fragment(torch.zeros(12, 256, dtype=torch.bfloat16), packed) == "next"
    assert ran == [one_form, float_zeros]
    # the batch kernel's row was measured on wgmma: on a GPU without it the product runs on the next row
    monkeypatch.setattr(table.kernels_gemm, "wgmma_available", lambda index: False)
    laid_out = random_w4_weight(64, 256, 128, "zero", True, seed=3)
    assert table.fragment_batch(torch.zeros(40, 256, dtype=torch.bfloat16), laid_out) == "next"
    assert ran == [one_form, float_zeros, laid_out]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_interleaved_gate_up_layout_puts_each_gate_row_beside_its_up_row(dtype):
    """The fused activation's layout: in each 16-row tile, rows j and 8 + j (one thread's mma rows g and g + 8) are
    gate row 8 t + j and up row 8 t + j of the merged [gate; up] weight, each the reference dequantizer's."""
    inner, in_features = 24, 192
    packed = random_w4_weight(2 * inner, in_features, 64, "zero", True, seed=5)
    weight = fragment.gate_up_layout(packed.qweight, packed.scales, packed.zeros, 64, in_features, dtype)
    unpacked = fragment.dequantize_fragments(weight, dtype)
    reference = dequantize(packed, torch.float32)
    gate, up = reference[:inner], reference[inner:]
    for tile in range(inner // 8):
        for j in range(8):
            assert torch.equal(unpacked[16 * tile + j], gate[8 * tile + j])
            assert torch.equal(unpacked[16 * tile + 8 + j], up[8 * tile + j])
    with pytest.raises(ValueError, match="multiple of 8"):
        fragment.gate_up_order(12)


def test_a_merged_gate_up_weight_holds_the_interleaved_layout_as_its_one_fragment_form(monkeypatch):
    """prepare_products: a gate/up weight (2048 x 2048, the smallest the fragment row takes) whose activation the
    MLP reads in the interleaved order keeps one fragment form, the interleaved one, with its bias in that row order,
    and no plain layout (so quant_matmul on it runs the rows after the fragment kernels'); the same weight not named
    a gate/up gets the plain one; 7B's gate/up, which the batch row serves at 33-128 tokens as well, gets one layout
    too. prepared_bytes counts one layout, the bias and the W4 GEMM's scale pairs where its row serves."""
    from deepinfer.core.ops import dispatch, quant_matmul
    from deepinfer.core.ops import quant_matmul_table as table

    monkeypatch.setattr(dispatch, "kernel_blocker", lambda devices: None)
    inner, in_features = 1024, 2048
    gate_up = random_w4_weight(2 * inner, in_features, 128, "zero", True, seed=11)
    gate_up.bias = torch.randn(2 * inner, dtype=torch.float16)
    plain = random_w4_weight(2 * inner, in_features, 128, "zero", True, seed=12)
    gate_ups = frozenset({id(gate_up)})
    expected = quant_matmul.prepared_bytes([gate_up, plain], torch.bfloat16, gate_ups)
    assert quant_matmul.prepare_products([gate_up, plain], torch.bfloat16, gate_ups=gate_ups) == 2
    assert table.fragment_weight(gate_up, torch.bfloat16) is None  # one form: no plain layout, now or later
    weight, bias = table.gate_up_fragment_weight(gate_up, torch.bfloat16)
    order = fragment.gate_up_order(inner)
    assert torch.equal(bias, gate_up.bias[order].to(torch.bfloat16))
    assert weight.frag.shape == (2 * inner // 16, in_features // 64, 32, 4)
    plain_weight = table.fragment_weight(plain, torch.bfloat16, lay_out=False)
    assert plain_weight is not None and table.gate_up_fragment_weight(plain, torch.bfloat16, lay_out=False) is None
    layout = weight.frag.numel() * 4 + weight.sz.numel() * 4
    assert layout == gate_up.qweight.numel() * 4 + (2 * inner) * (in_features // 128) * 4  # codes, a word pair a group
    assert plain_weight.frag.numel() * 4 + plain_weight.sz.numel() * 4 == layout
    assert not table.gemm_may_serve(gate_up)  # 2048 x 2048 is not larger than GEMM_LARGE_WEIGHT: no scale pairs
    assert expected == 2 * layout + 2 * inner * 2  # and the bias in bf16
    # 7B's gate/up (3584 x 37888): the fragment rows at 1-32 tokens and the batch row at 33-128 read one layout
    from deepinfer.core.quant.packed import PackedWeight

    large = PackedWeight(torch.empty(37888, 3584 // 8, dtype=torch.int32), torch.ones(37888, 28, dtype=torch.float16),
                         torch.zeros(37888, 28, dtype=torch.float16), 4, 128, 3584, 37888)
    assert table.gate_up_interleaves(large) and not table.gemm_may_serve(large)  # the fragment rows serve 1-128
    forms = quant_matmul.prepared_forms(large, torch.bfloat16, gate_up=True)
    assert forms == quant_matmul.PreparedForms(scale_pairs=False, fragment=False, gate_up_fragment=True)
    words = 37888 * 3584 // 8 + 37888 * 28  # the codes and a word per row and group
    assert quant_matmul.prepared_bytes([large], torch.bfloat16, frozenset({id(large)})) == 4 * words
    assert quant_matmul.prepared_bytes([large], torch.bfloat16, frozenset({id(large)}), fragments=False) == 0


def test_a_gate_up_product_over_the_interleaved_layout_returns_the_plain_outputs_in_interleaved_columns(monkeypatch):
    """gate_up_fragment_product on a small gate/up weight (2I = 512, K = 128; the rows' size floors lowered so the
    fragment row serves it at 17-32 tokens and the batch row at 33-96): the fragment kernels emulated in fp64 over
    the layout they are given (dequantize_fragments, the kernel's reading of it) return, over the interleaved layout
    and its bias, the plain layout's outputs with gate output 8 b + j at column 16 b + j and its up output at
    16 b + 8 + j; interleaved_halves gives back [gate | up]. The fused epilogue's token counts (to 16), and the
    rows that read the stored codes, are not this product's."""
    from deepinfer.core.ops import activation, dispatch
    from deepinfer.core.ops import quant_matmul_table as table
    from deepinfer.core.ops.gate_up_activation import interleaved_gate_up_product

    monkeypatch.setattr(dispatch, "kernel_blocker", lambda devices: None)
    monkeypatch.setattr(table, "FRAGMENT_WEIGHT", 1)
    monkeypatch.setattr(table, "FRAGMENT_BATCH_WIDE_WEIGHT", 1)
    monkeypatch.setattr(table.kernels_gemm, "wgmma_available", lambda index: True)

    def emulated(rows, weight, bias):
        out = rows.double() @ fragment.dequantize_fragments(weight, rows.dtype).double().T
        return out if bias is None else out + bias.double()

    for kernel in table.FRAGMENT_KERNELS:
        monkeypatch.setitem(table.FRAGMENT_PRODUCTS, kernel, table.FRAGMENT_PRODUCTS[kernel]._replace(
            product=emulated))
    table.product_row.cache_clear()
    try:
        inner, in_features = 256, 128
        packed = random_w4_weight(2 * inner, in_features, 128, "zero", True, seed=21)
        packed.bias = torch.randn(2 * inner, dtype=torch.float16)
        plain = fragment.fragment_layout(packed.qweight, packed.scales, packed.zeros, 128, 2 * inner, in_features,
                                         torch.bfloat16)
        x = torch.randn(100, in_features, dtype=torch.bfloat16)
        for tokens, kernel in ((20, "fragment"), (40, "fragment_batch")):
            shape = table.ProductShape(tokens, in_features, 2 * inner, 4, 128)
            assert table.product_row(shape).kernel == kernel
            assert not table.epilogue_serves(table.FRAGMENT_GATE_UP_ACT, shape)
            out = interleaved_gate_up_product(x[:tokens], packed, "silu")
            want = emulated(x[:tokens], plain, packed.bias.to(torch.bfloat16))  # the kernels take the bias in bf16
            gate, up = activation.interleaved_halves(out)
            assert torch.allclose(torch.cat([gate, up], dim=1), want, rtol=1e-12, atol=1e-12)
            assert torch.allclose(out, want[:, fragment.gate_up_order(inner)], rtol=1e-12, atol=1e-12)
        for tokens in (8, 100):  # tc (the fused epilogue's counts aside) and w4_gemm read the stored codes
            assert table.product_row(table.ProductShape(tokens, in_features, 2 * inner, 4, 128)).kernel in (
                "tcs", "w4_gemm")
            assert interleaved_gate_up_product(x[:tokens], packed, "silu") is None
        assert interleaved_gate_up_product(x[:20], packed, "gelu") is None  # no interleaved act_and_mul for it
        # the MLP: at 20 tokens neither fused epilogue serves, the product comes back interleaved and the
        # interleaved act_and_mul (its torch path: the emulated product is fp64) reads it as act(gate) * up
        from types import SimpleNamespace

        from deepinfer.core.models.layers import GatedMLP
        from deepinfer.core.quant.quant_linear import QuantLinear

        mlp = SimpleNamespace(gate_up_proj=QuantLinear(packed), down_proj=lambda inner_out: inner_out,
                              hidden_act="silu", inner=inner)
        want = emulated(x[:20], plain, packed.bias.to(torch.bfloat16))
        got = GatedMLP.forward(mlp, x[:20])
        assert torch.allclose(got, torch.nn.functional.silu(want[:, :inner]) * want[:, inner:], rtol=1e-12, atol=1e-12)
    finally:
        table.product_row.cache_clear()


def test_the_wide_batch_tiles_ring_fits_an_sm_at_every_group_size():
    """The 256-row wgmma tile's ring, hand-counted: 3 slots of 16 row tiles x 4 atoms x 512 bytes of weights, 64 (48)
    tokens x 256 k of bf16 activations and 16 row tiles x the stage's group slots x 64 bytes of scale entries; every
    launch shape, at every group size, within the 227 KiB an H100/H200 CTA may hold (1 KiB of it static)."""
    from deepinfer.kernels import w4_fragment_batch as batch

    wide, wide_48 = batch.WIDE_WGMMA_CONFIG, batch.WIDE_48_WGMMA_CONFIG
    assert (wide.rows, wide.tokens, wide.bk, wide.threads) == (256, 64, 256, 256)
    assert wide.shared_bytes(wide.group_steps(128, 4096)) == 3 * (32768 + 32768 + 16 * 2 * 64)
    assert wide.shared_bytes(wide.group_steps(32, 4096)) == 3 * (32768 + 32768 + 16 * 8 * 64)
    assert wide.shared_bytes(wide.group_steps(256, 4096)) == 3 * (32768 + 32768 + 16 * 1 * 64)
    assert wide_48.shared_bytes(wide_48.group_steps(128, 4096)) == 3 * (32768 + 24576 + 16 * 2 * 64)
    for config in batch.CONFIGS:
        for group_size in (32, 64, 128, 256, 4096):
            assert config.shared_bytes(config.group_steps(group_size, 4096)) + 1024 <= 227 * 1024


def test_the_batch_kernels_plan_shares_whole_k_blocks_among_one_cta_an_sm(monkeypatch):
    """w4_fragment_batch's stream-K work: tiles of 128 rows (256 on the wide wgmma tile) x 64 tokens x k blocks of
    256, hand-counted; one CTA an SM (132), fewer where a CTA would get under 3 k blocks; the wide wgmma launch shape
    where the GPU has wgmma."""
    from deepinfer.kernels import w4_fragment_batch as batch

    monkeypatch.setattr(batch, "_num_sms", lambda index: 132)
    monkeypatch.setattr(batch, "wgmma_available", lambda index: True)
    # 7B's gate/up at 64 tokens: 37888 / 128 = 296 row blocks, one token block, 3584 / 256 = 14 k blocks
    assert batch.iterations(64, 37888, 3584) == 4144
    assert batch.iterations(64, 37888, 3584, batch.WIDE_WGMMA_CONFIG) == 148 * 14
    assert batch.plan(64, 37888, 3584, 0) == (batch.WIDE_WGMMA_CONFIG, 132)
    # 48-token blocks where they pad less: 40 and 96 tokens (48 / 96 against 64 / 128), not 64, 100 or 128
    assert [batch.plan(m, 37888, 3584, 0)[0].tokens for m in (40, 48, 64, 96, 100, 128)] == [48, 48, 64, 48, 64, 64]
    # 100 tokens: two token blocks; N = 1000: 63 row tiles in 8 row blocks (4 of 256 rows); K = 2048 + 64: 9 k blocks
    assert batch.iterations(100, 1000, 2112) == 8 * 2 * 9
    assert batch.plan(100, 1000, 2112, 0)[1] == 24  # 4 * 2 * 9 // 3 (64-token blocks: 100 -> 128 < 144)
    assert batch.plan(100, 1000, 2112, 0, batch.WGMMA_CONFIG)[1] == 48  # 144 // 3
    monkeypatch.setattr(batch, "wgmma_available", lambda index: False)
    assert batch.plan(40, 40, 160, 0) == (batch.CONFIG, 1)  # one k block: one CTA
