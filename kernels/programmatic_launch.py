"""Programmatic dependent launch (PDL): kernels launched through the driver's cuLaunchKernelEx with the
programmatic-stream-serialization attribute, on GPUs that have it (compute capability 9.0 and up).

With the attribute, the next kernel of a stream may start while the previous one runs: its CTAs take free
SM slots, do what depends on no earlier kernel (the tc, tcs and ksplit GEMVs load their first weights), then
block in `griddepcontrol.wait` until the previous grid has completed and its writes are visible (common.cuh:
`launch_dependents`, `wait_for_prior_grids`; every deepinfer kernel calls both). A decode step is ~400
short kernels, so each one's launch latency and first DRAM round trip, otherwise paid in series, now overlap
the kernel before it. CUDA-graph capture records the attribute as a programmatic edge.

CuPy launches only through cuLaunchKernel, so this calls libcuda through ctypes, with the structures of
cuda.h (CUDA 12.0+). DEEPINFER_PDL=0 turns it off (every launch then goes through CuPy, fully serialized).
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from functools import cache

import numpy as np

# cuda.h: CUlaunchAttributeID values
_CLUSTER_DIMENSION = 4
_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_MAX_ARGS = 64
_SLOT = 8  # bytes per kernel argument in the parameter buffer: every deepinfer argument is 4 or 8 bytes
# struct format of one argument's 8-byte slot, by its numpy type (ptr / i32 / i64 / f32 in launch.py)
_SLOT_FORMATS = {np.uint64: "Q", np.int32: "i4x", np.int64: "q", np.float32: "f4x"}


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: a 4-byte id, padding to 8, and a 64-byte value union, here as 16 unsigned ints (the
    programmatic flag is the first; a cluster's dimensions are the first three)."""

    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_uint), ("value", ctypes.c_uint * 16)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def slot_format(args: tuple) -> str:
    """The struct format that packs `args` (ptr/i32/i64/f32 values) into consecutive 8-byte slots."""
    return "<" + "".join(_SLOT_FORMATS[type(arg)] for arg in args)


def enabled(compute_capability: str) -> bool:
    """Whether launches on a device of this compute capability ('90') go through PDL."""
    return os.environ.get("DEEPINFER_PDL", "1") != "0" and int(compute_capability) >= 90


class _Launcher(threading.local):
    """One thread's reusable launch structures. The driver reads the parameters during the call, so the
    buffers can be refilled by the next launch."""

    def __init__(self):
        self.params = ctypes.create_string_buffer(_SLOT * _MAX_ARGS)
        base = ctypes.addressof(self.params)
        self.param_ptrs = (ctypes.c_void_p * _MAX_ARGS)(*(base + _SLOT * i for i in range(_MAX_ARGS)))
        self.attributes = (LaunchAttribute * 2)()
        self.config = LaunchConfig(attrs=self.attributes)


_launcher = _Launcher()
_functions: dict[tuple[int, int], int] = {}  # (id of a loaded kernel, device) -> CUfunction
_formats: dict[tuple[type, ...], str] = {}


@cache
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                     ctypes.c_void_p]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def launch(kernel, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, stream_handle: int,
           device_index: int, shared_mem: int = 0, programmatic: bool = True,
           cluster: tuple[int, int, int] | None = None) -> None:
    """Launch a compiled cupy.RawKernel on a raw stream handle through cuLaunchKernelEx: with the PDL attribute
    (`programmatic`) and/or as thread-block clusters of `cluster` CTAs (x, y, z; SM90+, each grid dimension a
    multiple). The caller has made `device_index` current and typed every argument (launch.py)."""
    lib = _driver()
    key = (id(kernel), device_index)
    function = _functions.get(key)
    if function is None:
        function = _functions[key] = kernel.kernel.ptr  # the CUfunction CuPy loaded for the current device
    types = tuple(map(type, args))
    fmt = _formats.get(types)
    if fmt is None:
        if len(args) > _MAX_ARGS:
            raise ValueError(f"{len(args)} kernel arguments exceed {_MAX_ARGS}")
        fmt = _formats[types] = slot_format(args)
    state = _launcher
    struct.pack_into(fmt, state.params, 0, *args)
    config = state.config
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = shared_mem
    config.hStream = stream_handle
    count = 0
    if programmatic:
        state.attributes[count].id, state.attributes[count].value[0] = _PROGRAMMATIC_STREAM_SERIALIZATION, 1
        count += 1
    if cluster is not None:
        attribute = state.attributes[count]
        attribute.id = _CLUSTER_DIMENSION
        attribute.value[0], attribute.value[1], attribute.value[2] = cluster
        count += 1
    config.numAttrs = count
    status = lib.cuLaunchKernelEx(ctypes.byref(config), function, state.param_ptrs, None)
    if status != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(status, ctypes.byref(name))
        raise RuntimeError(f"cuLaunchKernelEx failed: {(name.value or b'?').decode()} ({status})")
