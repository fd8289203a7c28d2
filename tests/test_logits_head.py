"""The vocabulary head on the CPU: fp16 under the packed CPU layouts, the reference's bits under `dense`."""

import pytest
import torch
import torch.nn.functional as F

from deepinfer.core.ops.logits_head import logits_head
from deepinfer.core.ops.quant_matmul_cpu import CPU_WEIGHTS_ENV


def head_case(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # a GGUF's embedding: fp16 values held in fp32; hidden states of a final RMSNorm's scale
    weight = (torch.randn(4099, 96, generator=generator) * 0.05).half().float()
    hidden = torch.randn(3, 96, generator=generator) * 3
    return hidden, weight


def test_dense_mode_is_the_plain_fp32_product(monkeypatch):
    monkeypatch.setenv(CPU_WEIGHTS_ENV, "dense")
    hidden, weight = head_case()
    assert torch.equal(logits_head(hidden, weight), F.linear(hidden, weight))


@pytest.mark.parametrize("mode", ["packed", "int4"])
def test_packed_modes_round_the_hidden_state_to_fp16_only(monkeypatch, mode):
    monkeypatch.setenv(CPU_WEIGHTS_ENV, mode)
    hidden, weight = head_case()
    logits = logits_head(hidden, weight)
    exact = (hidden.double() @ weight.double().T)
    # the fp16 weight is exact; the hidden state's rounding (2**-11 relative) bounds the error, with the output's
    rounding = hidden.abs().double() @ weight.abs().double().T * 2**-11 + exact.abs() * 2**-11
    assert logits.dtype == torch.float32 and logits.shape == (3, 4099)
    assert ((logits.double() - exact).abs() <= rounding + 1e-6).all()
    assert not torch.equal(logits, F.linear(hidden, weight))  # it did take the fp16 product
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))


def test_the_copy_follows_an_in_place_write(monkeypatch):
    monkeypatch.setenv(CPU_WEIGHTS_ENV, "packed")
    hidden, weight = head_case()
    before = logits_head(hidden, weight)
    with torch.no_grad():
        weight.mul_(2)  # a load fills parameters in place after the model is built
    assert torch.allclose(logits_head(hidden, weight), 2 * before, rtol=1e-2, atol=1e-2)
