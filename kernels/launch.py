"""Launching a compiled kernel on torch's current CUDA stream, with exactly typed scalars.

Every argument goes through one of `ptr`, `i32`, `i64`, `f32`: CuPy turns a bare Python float into
a double and a bare int into an int64, which silently corrupts a kernel that declares `float` or
`int` (a scale then reads as 0, a softcap as garbage). Launches use torch's current stream, so
they order correctly with torch ops and are recorded by torch.cuda.graph captures; nothing here
allocates device memory or synchronizes. On compute capability 9.0+ every launch is a programmatic
dependent launch (programmatic_launch.py; DEEPINFER_PDL=0 turns that off).
"""

from __future__ import annotations

import warnings
from functools import cache
from typing import TypeVar

import numpy as np
import torch

from deepinfer.kernels import programmatic_launch

_streams: dict[tuple[int, int], object] = {}
_ARG_TYPES = (np.uint64, np.int32, np.int64, np.float32)

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
Plan = TypeVar("Plan")


def ptr(tensor: torch.Tensor | None) -> np.uint64:
    """Device address of a tensor's first element (0 for None), as a 64-bit kernel argument."""
    return np.uint64(0 if tensor is None else tensor.data_ptr())


def i32(value: int) -> np.int32:
    value = int(value)
    if not _INT32_MIN <= value <= _INT32_MAX:
        raise ValueError(f"{value} does not fit a 32-bit kernel argument")
    return np.int32(value)


def i64(value: int) -> np.int64:
    return np.int64(int(value))


def f32(value: float) -> np.float32:
    return np.float32(float(value))


def _torch_stream(device_index: int):
    """CuPy's view of torch's current stream on the device, made once per (device, stream handle).
    The handle comes from torch's C accessor: building a torch.cuda.Stream object per launch would cost
    more host time than the rest of the launch."""
    import cupy

    handle = torch._C._cuda_getCurrentRawStream(device_index)
    stream = _streams.get((device_index, handle))
    if stream is None:
        with warnings.catch_warnings():  # CuPy 14 prefers Stream.from_external; older CuPys lack it
            warnings.simplefilter("ignore", DeprecationWarning)
            stream = cupy.cuda.ExternalStream(handle, device_index)
        _streams[(device_index, handle)] = stream
    return stream


@cache
def _programmatic(device_index: int) -> bool:
    from deepinfer.kernels.compiler import device_arch

    return programmatic_launch.enabled(device_arch(device_index))


@cache
def clusters_available(device_index: int) -> bool:
    """Whether the device launches thread-block clusters (compute capability 9.0+)."""
    from deepinfer.kernels.compiler import device_arch

    return int(device_arch(device_index)) >= 90


def launch(kernel, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, device_index: int,
           shared_mem: int = 0, cluster: tuple[int, int, int] | None = None) -> None:
    """Launch on torch's current stream of `device_index`, as a programmatic dependent launch where the GPU
    has it (programmatic_launch.py). args: only ptr/i32/i64/f32 values. cluster: thread-block cluster dimensions
    (compute capability 9.0+; such launches always go through the driver, with PDL or without)."""
    for arg in args:
        if type(arg) not in _ARG_TYPES:
            raise TypeError(f"kernel argument {arg!r} must be typed with ptr/i32/i64/f32")
    import cupy

    programmatic = _programmatic(device_index)
    if programmatic or cluster is not None:
        with cupy.cuda.Device(device_index):
            programmatic_launch.launch(kernel, grid, block, args, torch._C._cuda_getCurrentRawStream(device_index),
                                       device_index, shared_mem, programmatic, cluster)
        return
    with cupy.cuda.Device(device_index), _torch_stream(device_index):
        kernel(grid, block, args, shared_mem=shared_mem)


def product_operands(x: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                     out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The operands of a product kernel that reads x [M, K] in 16-byte loads: x contiguous and 16-byte aligned (a
    copy where it is not), bias [N] contiguous in x's dtype, out [M, N] in x's dtype (made where None)."""
    if x.data_ptr() % 16 or not x.is_contiguous():
        x = x.contiguous().clone()
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        bias = bias.to(x.dtype).contiguous()
    if out is None:
        out = torch.empty(x.shape[0], out_features, dtype=x.dtype, device=x.device)
    return x, bias, out


def planned_launch(planned: tuple[Plan, int], config: Plan | None, splits: int | None) -> tuple[Plan, int]:
    """(launch shape, K splits): the plan's, each replaced by the caller's where given (benchmarks, validation)."""
    return config or planned[0], splits or planned[1]
