"""Gated activations act(gate) * up: kernel when one serves the case, torch otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.core.ops import dispatch


def act_and_mul_reference(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation == "gelu":
        return F.gelu(gate) * up
    raise ValueError(f"unknown activation {activation!r}")


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """gate, up [T, I] -> act(gate) * up [T, I]; activation "silu" | "gelu_tanh" | "gelu".

    gate and up may be the two halves of one merged projection (`gu[:, :I]`, `gu[:, I:]`).
    """
    from deepinfer.kernels import registry

    op = registry.get("act_and_mul")
    # the kernel's checks read shapes, strides and 16-byte alignment; only the token count is left out
    key = (activation, gate.device, up.device, gate.dtype, up.dtype, gate.shape[1:], gate.shape == up.shape,
           gate.stride(), up.stride(), gate.data_ptr() % 16, up.data_ptr() % 16)
    if dispatch.decide(op.name, key, lambda: dispatch.kernel_blocker(gate, up)
                       or op.unsupported_reason(gate, up, activation)):
        return op.launch(gate, up, activation)
    return act_and_mul_reference(gate, up, activation)
