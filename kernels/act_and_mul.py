"""Launcher of act_and_mul.cu: SiLU(gate) * up or GeLU-tanh(gate) * up."""

from __future__ import annotations

import torch

from deepinfer.kernels.compiler import get_kernel
from deepinfer.kernels.launch import i32, i64, launch, ptr

SOURCE = "act_and_mul.cu"
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def unsupported_reason(gate: torch.Tensor, up: torch.Tensor, activation: str) -> str | None:
    if activation not in ACTIVATIONS:
        return f"activation {activation!r}"
    if gate.dtype not in _DTYPE_CODES or up.dtype != gate.dtype:
        return f"dtypes {gate.dtype}/{up.dtype} (kernel takes float16/bfloat16)"
    if gate.dim() != 2 or gate.shape != up.shape:
        return f"shapes {tuple(gate.shape)} / {tuple(up.shape)} (kernel takes two [T, I] tensors)"
    for tensor in (gate, up):
        if tensor.stride(1) != 1 or tensor.stride(0) % 8 or tensor.data_ptr() % 16 or gate.shape[1] % 8:
            return "rows not 16-byte aligned (kernel reads 8 elements at a time)"
    return None


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, activation: str, out: torch.Tensor | None = None,
                ) -> torch.Tensor:
    """gate, up [T, I] (row strides may differ, e.g. halves of one [T, 2I]) -> act(gate) * up [T, I]."""
    num_tokens, inner = gate.shape
    if out is None:
        out = torch.empty(num_tokens, inner, dtype=gate.dtype, device=gate.device)
    total_vectors = num_tokens * inner // 8
    if total_vectors == 0:
        return out
    index = gate.device.index
    name = f"act_and_mul_kernel<{_DTYPE_CODES[gate.dtype]},{ACTIVATIONS[activation]}>"
    blocks = min(-(-total_vectors // 256), 65535)
    launch(get_kernel(SOURCE, name, index), (blocks, 1, 1), (256, 1, 1), (
        ptr(gate), ptr(up), ptr(out), i32(num_tokens), i32(inner), i64(gate.stride(0)), i64(up.stride(0))), index)
    return out
