"""Gated activations act(gate) * up: kernel when one serves the case, torch otherwise."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from deepinfer.core.ops import dispatch
from deepinfer.kernels import act_and_mul as kernels

OP = "act_and_mul"


class ActCase(NamedTuple):
    devices: tuple[torch.device, ...]  # gate's and up's
    activation: str
    gate_dtype: torch.dtype
    up_dtype: torch.dtype
    shapes_match: bool  # two [T, I] tensors of one shape
    inner: int
    aligned: bool  # every row of both contiguous and 16-byte aligned

    @classmethod
    def of(cls, gate: torch.Tensor, up: torch.Tensor, activation: str) -> ActCase:
        return cls((gate.device, up.device), activation, gate.dtype, up.dtype,
                   gate.dim() == 2 and gate.shape == up.shape, gate.shape[-1],
                   kernels.rows_aligned(gate) and kernels.rows_aligned(up))


def _reason(case: ActCase) -> str | None:
    return kernels.unsupported_reason(case.activation, case.gate_dtype, case.up_dtype, case.shapes_match, case.inner,
                                      case.aligned)


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
    if dispatch.decide(OP, ActCase.of(gate, up, activation), _reason, (gate, up)):
        return kernels.act_and_mul(gate, up, activation)
    return act_and_mul_reference(gate, up, activation)
