"""act_and_mul over a [T, 2I] product whose columns interleave gate and up in 8-column blocks (the column order of a
gate/up product over the interleaved fragment layout, kernels/w4_fragment_gemm.py gate_up_order): column 16 b + j is
gate column 8 b + j and 16 b + 8 + j its up column. On the CPU the torch path against a hand-placed case and the
plain act_and_mul of the halves; on the GPU the kernel's interleaved variant against its plain variant on the same
values (the same bits) and the torch reference."""

from __future__ import annotations

import pytest
import torch

from deepinfer.core.ops.activation import (
    ActCase,
    _reason,
    act_and_mul,
    act_and_mul_interleaved,
    act_and_mul_reference,
    interleaved_halves,
)
from deepinfer.kernels.w4_fragment_gemm import gate_up_order


def test_interleaved_halves_reads_column_16b_plus_j_as_gate_8b_plus_j_and_16b_plus_8_plus_j_as_its_up():
    inner = 16
    gate = torch.arange(inner, dtype=torch.float32)[None].repeat(3, 1) + 100 * torch.arange(3.0)[:, None]
    up = -gate - 1
    gate_up = torch.empty(3, 2 * inner)
    for block in range(inner // 8):
        for j in range(8):
            gate_up[:, 16 * block + j] = gate[:, 8 * block + j]
            gate_up[:, 16 * block + 8 + j] = up[:, 8 * block + j]
    assert torch.equal(gate_up, torch.cat([gate, up], dim=1)[:, gate_up_order(inner)])
    got_gate, got_up = interleaved_halves(gate_up)
    assert torch.equal(got_gate, gate) and torch.equal(got_up, up)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_interleaved_torch_path_gives_the_bits_of_act_and_mul_on_the_halves(activation, dtype):
    inner = 48
    gate, up = (torch.randn(5, inner, generator=torch.Generator().manual_seed(seed)).to(dtype) * 3 for seed in (1, 2))
    gate_up = torch.cat([gate, up], dim=1)[:, gate_up_order(inner)]
    assert torch.equal(act_and_mul_interleaved(gate_up, activation).view(torch.int16),
                       act_and_mul(gate, up, activation).view(torch.int16))


def test_the_kernel_takes_interleaved_products_of_whole_8_column_blocks_only():
    aligned = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert _reason(ActCase.of_interleaved(aligned, "silu")) is None
    assert _reason(ActCase.of_interleaved(torch.zeros(4, 72, dtype=torch.bfloat16), "silu")) is not None  # I = 36
    assert _reason(ActCase.of_interleaved(aligned, "gelu")) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,inner", [(5, 1536), (64, 11008), (1, 8)])
def test_the_interleaved_kernel_gives_the_plain_kernels_bits(rows, inner, activation, dtype):
    from deepinfer.kernels import act_and_mul as kernels

    device = torch.device("cuda")
    gate_up = torch.randn(rows, 2 * inner, dtype=dtype, device=device) * 3
    interleaved = gate_up[:, gate_up_order(inner, device)].contiguous()
    plain = kernels.act_and_mul(gate_up[:, :inner], gate_up[:, inner:], activation)
    out = torch.full((rows, inner), float("nan"), dtype=dtype, device=device)
    kernels.act_and_mul_interleaved(interleaved, activation, out=out)
    assert torch.equal(out.view(torch.int16), plain.view(torch.int16))
    reference = act_and_mul_reference(gate_up[:, :inner].float(), gate_up[:, inner:].float(), activation)
    assert float((out.float() - reference).norm() / reference.norm()) < 1e-2
