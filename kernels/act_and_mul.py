"""Launcher of act_and_mul.cu: SiLU(gate) * up or GeLU-tanh(gate) * up, of gate and up [T, I] tensors or of one
[T, 2I] product whose columns interleave them in 8-column blocks."""

from __future__ import annotations

import torch

from deepinfer.kernels.compiler import get_kernel
from deepinfer.kernels.launch import i32, i64, launch, ptr

SOURCE = "act_and_mul.cu"
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def fused_epilogue_operands(x: torch.Tensor, activation: str, out_features: int,
                            out: torch.Tensor | None) -> tuple[int, torch.Tensor]:
    """(activation code, out [M, out_features / 2] in x's dtype, made where None) of a product kernel whose
    epilogue applies act(gate) * up to a merged [gate | up] weight of `out_features` rows."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}")
    if out is None:
        out = torch.empty(x.shape[0], out_features // 2, dtype=x.dtype, device=x.device)
    return ACTIVATIONS[activation], out


def rows_aligned(tensor: torch.Tensor) -> bool:
    """Whether every row of a [T, I] tensor is contiguous and starts on a 16-byte boundary (the kernel reads 8
    elements at a time)."""
    return tensor.stride(-1) == 1 and tensor.stride(0) % 8 == 0 and tensor.data_ptr() % 16 == 0


def unsupported_reason(activation: str, gate_dtype: torch.dtype, up_dtype: torch.dtype, shapes_match: bool,
                       inner: int, aligned: bool) -> str | None:
    """Why the kernel cannot compute act(gate) * up (None when it can). shapes_match: gate and up are [T, I]
    tensors of one shape; aligned: rows_aligned for both."""
    if activation not in ACTIVATIONS:
        return f"activation {activation!r}"
    if gate_dtype not in _DTYPE_CODES or up_dtype != gate_dtype:
        return f"dtypes {gate_dtype}/{up_dtype} (kernel takes float16/bfloat16)"
    if not shapes_match:
        return "gate and up are not two [T, I] tensors of one shape"
    if not aligned or inner % 8:
        return "rows not 16-byte aligned (kernel reads 8 elements at a time)"
    return None


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, activation: str, out: torch.Tensor | None = None,
                ) -> torch.Tensor:
    """gate, up [T, I] (row strides may differ, e.g. halves of one [T, 2I]) -> act(gate) * up [T, I]."""
    return _launch(gate, up, gate.shape[1], activation, False, out)


def act_and_mul_interleaved(gate_up: torch.Tensor, activation: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2I] in 8-column blocks (column 16 b + j: gate column 8 b + j, 16 b + 8 + j: its up column; the
    column order of a product over kernels/w4_fragment_gemm.py's gate_up_layout) -> act(gate) * up [T, I], the same
    arithmetic as act_and_mul on the [gate | up] halves."""
    return _launch(gate_up, gate_up[:, 8:], gate_up.shape[1] // 2, activation, True, out)


def _launch(gate: torch.Tensor, up: torch.Tensor, inner: int, activation: str, interleaved: bool,
            out: torch.Tensor | None) -> torch.Tensor:
    num_tokens = gate.shape[0]
    if out is None:
        out = torch.empty(num_tokens, inner, dtype=gate.dtype, device=gate.device)
    total_vectors = num_tokens * inner // 8
    if total_vectors == 0:
        return out
    index = gate.device.index
    name = f"act_and_mul_kernel<{_DTYPE_CODES[gate.dtype]},{ACTIVATIONS[activation]},{int(interleaved)}>"
    blocks = min(-(-total_vectors // 256), 65535)
    launch(get_kernel(SOURCE, name, index), (blocks, 1, 1), (256, 1, 1), (
        ptr(gate), ptr(up), ptr(out), i32(num_tokens), i32(inner), i64(gate.stride(0)), i64(up.stride(0))), index)
    return out
