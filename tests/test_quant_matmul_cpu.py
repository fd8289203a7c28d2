"""CPU products of packed weights (core/ops/quant_matmul_cpu.py) against the reference dequantizer + matmul.

The packed layout runs torch's int4 kernel on bf16-rounded activations, scales and zeros (fp32 accumulation), so
it is held to a bound of 2**-7 of sum |x| |w| per output; the dense layout is the reference's own weight and
matmul, so it must match bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.core.ops import quant_matmul_cpu as cpu_op
from deepinfer.core.ops.quant_matmul import quant_matmul
from deepinfer.core.quant.packing import dequantize, pack_weight


def _weight(bits: int, out_features: int, in_features: int, group_size: int, zero_mode: str, seed: int,
            act_order: bool = False, bias: bool = False):
    gen = torch.Generator().manual_seed(seed)
    groups = in_features // group_size
    codes = torch.randint(0, 2**bits, (out_features, in_features), generator=gen, dtype=torch.int32)
    scales = (torch.rand(out_features, groups, generator=gen) * 0.02 + 0.001).to(torch.float16)
    if zero_mode == "zero":  # GPTQ / RTN: whole-number zero points; AWQ-style fractional ones too
        zeros = torch.randint(0, 2**bits, (out_features, groups), generator=gen).to(torch.float16)
        zeros[:, ::2] += 0.5
    else:  # GGUF Q4_1 / Q4_K: a float minimum
        zeros = (-torch.rand(out_features, groups, generator=gen) * 0.1).to(torch.float16)
    perm = torch.randperm(in_features, generator=gen) if act_order else None
    b = torch.randn(out_features, generator=gen) if bias else None
    return pack_weight(codes, scales, zeros, bits, zero_mode=zero_mode, input_perm=perm, bias=b)


def _reference(x: torch.Tensor, packed) -> torch.Tensor:
    out = x @ dequantize(packed, torch.float32).T
    return out if packed.bias is None else out + packed.bias


def _assert_within_bf16_rounding(out: torch.Tensor, x: torch.Tensor, packed) -> None:
    """|out - reference| <= 2**-7 * sum_k |x_k| m_k: m bounds the magnitude of each weight and of the zero term the
    kernel adds per group (it computes (q - 8) * s + zero', |zero'| <= 8 s + |zero term|), all rounded to bf16."""
    expected = _reference(x, packed)
    scales, zeros = packed.scales.float(), packed.zeros.float()
    zero_term = zeros * scales if packed.zero_mode == "zero" else zeros
    extra = (8 * scales + zero_term.abs()).repeat_interleave(packed.group_size, dim=1)  # [N, K], stored order
    if packed.input_perm is not None:
        unpermuted = torch.empty_like(extra)
        unpermuted[:, packed.input_perm.long()] = extra
        extra = unpermuted
    bound = 2**-7 * (x.abs() @ (dequantize(packed).abs() + extra).T) + 1e-6
    assert out.dtype == torch.float32 and out.shape == expected.shape
    assert bool(((out - expected).abs() <= bound).all()), float((out - expected).abs().max())


CASES = [  # bits, N, K, group size, zero mode
    (4, 64, 256, 32, "min"),
    (4, 96, 256, 64, "zero"),
    (4, 48, 512, 128, "zero"),
    (4, 32, 512, 256, "min"),
    (4, 64, 192, 192, "zero"),  # per-channel: served with group 64, the scale pair repeated
    (3, 64, 256, 32, "zero"),
    (3, 80, 256, 128, "min"),
]


@pytest.mark.parametrize("bits,out_features,in_features,group_size,zero_mode", CASES)
@pytest.mark.parametrize("tokens", [1, 5, 33, 80])  # 80: a prefill, the bf16 dense copy
def test_packed_matches_reference_within_bf16_rounding(monkeypatch, bits, out_features, in_features, group_size,
                                                       zero_mode, tokens):
    monkeypatch.setenv(cpu_op.CPU_WEIGHTS_ENV, "packed")
    packed = _weight(bits, out_features, in_features, group_size, zero_mode, seed=tokens + bits,
                     act_order=group_size == 32, bias=bits == 3)
    assert cpu_op.cpu_weight(packed, torch.float32).is_int4
    x = torch.randn(tokens, in_features, generator=torch.Generator().manual_seed(1)) + 0.5  # a mean: offsets show
    with torch.inference_mode():
        out = quant_matmul(x, packed)
    _assert_within_bf16_rounding(out, x, packed)


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_dense_layout_is_the_reference_bit_for_bit(monkeypatch, bits):
    monkeypatch.setenv(cpu_op.CPU_WEIGHTS_ENV, "dense")
    packed = _weight(bits, 64, 256, 64, "zero", seed=bits, bias=True)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        out = quant_matmul(x, packed)
    assert torch.equal(out, _reference(x, packed))


def test_8bit_and_odd_rows_fall_back_to_dense():
    assert cpu_op.cpu_weight(_weight(8, 64, 256, 32, "zero", 0), torch.float32, "packed").is_int4 is False
    assert cpu_op.cpu_weight(_weight(4, 40, 256, 32, "zero", 0), torch.float32, "packed").is_int4 is False  # N % 16


def test_layout_is_made_once_and_remade_after_an_in_place_write(monkeypatch):
    monkeypatch.setenv(cpu_op.CPU_WEIGHTS_ENV, "packed")
    made = []
    original = cpu_op.int4_layout
    monkeypatch.setattr(cpu_op, "int4_layout", lambda packed: made.append(1) or original(packed))
    packed = _weight(4, 64, 256, 32, "min", seed=3)
    x = torch.randn(2, 256)
    with torch.inference_mode():
        first = quant_matmul(x, packed)
        for _ in range(3):
            assert torch.equal(quant_matmul(x, packed), first)
    assert len(made) == 1
    packed.scales.mul_(2)  # in place: the layout must follow
    with torch.inference_mode():
        again = quant_matmul(x, packed)
    assert len(made) == 2
    assert not torch.equal(again, first)
    _assert_within_bf16_rounding(again, x, packed)


def test_bad_mode_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(cpu_op.CPU_WEIGHTS_ENV, "fast")
    with pytest.raises(ValueError, match="packed, int4 or dense"):
        cpu_op.cpu_weights_mode()


@pytest.fixture(scope="module")
def smollm2_converted(smollm2_gguf, tmp_path_factory):
    from deepinfer.core.weights.convert.run import convert_checkpoint

    out = tmp_path_factory.mktemp("smollm2-cpu") / "w4"
    convert_checkpoint(smollm2_gguf, out)
    return out


def test_converted_smollm2_decodes_the_gguf_tokens_on_the_packed_path(monkeypatch, smollm2_gguf, smollm2_converted):
    """The conversion holds the GGUF's own Q4_1 codes and the GGUF path packs the same codes on the CPU, so both
    run the same int4 products: the greedy tokens must be equal, and every projection must be a packed one."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.core.quant.quant_linear import QuantLinear

    monkeypatch.setenv(cpu_op.CPU_WEIGHTS_ENV, "packed")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    answers = {}
    for name, model in (("gguf", smollm2_gguf), ("converted", smollm2_converted)):
        llm = LLM(model=str(model), device="cpu")
        quantized = [m for m in llm.engine.model.modules() if isinstance(m, QuantLinear)]
        assert len(quantized) == 30 * 4  # qkv, o, gate_up, down of every layer
        assert all(cpu_op.cpu_weight(m.packed, torch.float32).is_int4 for m in quantized)
        answers[name] = llm.generate([llm.tokenizer.encode_chat(messages)], params)[0].outputs[0]
    assert answers["converted"].token_ids == answers["gguf"].token_ids
    assert answers["gguf"].text.startswith("The capital of France is Paris")
