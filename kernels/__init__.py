"""deepinfer's CUDA kernels: CUDA C sources (*.cu), compiled at run time by NVRTC through CuPy.

Nothing here imports `core`: the launchers take plain torch tensors and numbers, and `core/ops`
decides when to call them. CuPy is imported lazily, so this package imports on machines without it.
"""

from __future__ import annotations

import functools

MIN_COMPUTE_CAPABILITY = (8, 0)  # mma.sync bf16, cvt.rn.bf16x2 and friends need sm_80+


@functools.cache
def cuda_unavailable_reason() -> str | None:
    """Why no kernel can run on this machine at all (CuPy missing, no device), or None."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install cupy-cuda12x or cupy-cuda13x)"
    except (OSError, RuntimeError) as err:  # a broken CUDA install raises at import time
        return f"CuPy cannot be imported: {err}"
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return "CuPy sees no CUDA device"
    except (OSError, RuntimeError) as err:
        return f"CuPy cannot reach a CUDA device: {err}"
    return None


@functools.cache
def device_unsupported_reason(device_index: int) -> str | None:
    """Why the kernels cannot run on this device (compute capability too old), or None."""
    import torch

    capability = torch.cuda.get_device_capability(device_index)
    if capability < MIN_COMPUTE_CAPABILITY:
        major, minor = MIN_COMPUTE_CAPABILITY
        return f"GPU is sm_{capability[0]}{capability[1]}; the kernels need sm_{major}{minor} or newer"
    return None
