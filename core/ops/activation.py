"""Gated activations act(gate) * up: kernel when one serves the case, torch otherwise. gate and up come as two
[T, I] tensors (or the halves of one [T, 2I] product), or interleaved in 8-column blocks of one [T, 2I] product
(the column order of a gate/up product over the interleaved fragment layout: act_and_mul_interleaved)."""

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
    interleaved: bool = False  # gate and up in 8-column blocks of one [T, 2I] tensor

    @classmethod
    def of(cls, gate: torch.Tensor, up: torch.Tensor, activation: str) -> ActCase:
        return cls((gate.device, up.device), activation, gate.dtype, up.dtype,
                   gate.dim() == 2 and gate.shape == up.shape, gate.shape[-1],
                   kernels.rows_aligned(gate) and kernels.rows_aligned(up))

    @classmethod
    def of_interleaved(cls, gate_up: torch.Tensor, activation: str) -> ActCase:
        return cls((gate_up.device,), activation, gate_up.dtype, gate_up.dtype,
                   gate_up.dim() == 2 and gate_up.shape[-1] % 16 == 0, gate_up.shape[-1] // 2,
                   kernels.rows_aligned(gate_up), True)


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


def interleaved_halves(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [T, 2I] in 8-column blocks (column 16 b + j: gate column 8 b + j, 16 b + 8 + j: its up column) ->
    (gate, up) [T, I] each, in their own column order."""
    blocks = gate_up.view(gate_up.shape[0], -1, 2, 8)  # [T, I / 8, (gate, up), 8]
    return blocks[:, :, 0].reshape(gate_up.shape[0], -1), blocks[:, :, 1].reshape(gate_up.shape[0], -1)


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """gate, up [T, I] -> act(gate) * up [T, I]; activation "silu" | "gelu_tanh" | "gelu".

    gate and up may be the two halves of one merged projection (`gu[:, :I]`, `gu[:, I:]`).
    """
    if dispatch.decide(OP, ActCase.of(gate, up, activation), _reason, (gate, up)):
        return kernels.act_and_mul(gate, up, activation)
    return act_and_mul_reference(gate, up, activation)


def act_and_mul_interleaved(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """gate_up [T, 2I] with gate and up interleaved in 8-column blocks (interleaved_halves) -> act(gate) * up [T, I],
    the same bits as act_and_mul of the two halves."""
    if dispatch.decide(OP, ActCase.of_interleaved(gate_up, activation), _reason, (gate_up,)):
        return kernels.act_and_mul_interleaved(gate_up, activation)
    return act_and_mul_reference(*interleaved_halves(gate_up), activation)
