"""Which attention backend the engine runs, and which kernels its ops ended up on.

`attention_backend`:
- "torch": the reference (gather + SDPA), any device and dtype;
- "native": the paged decode kernel for decodes (core/attention/native_backend.py); refused with a
  one-line reason when the kernels cannot serve this model here;
- "auto": native when it can serve, else torch (the reason is logged).

Native serves when the device is a CUDA GPU the kernels support (sm_80+), CuPy imports, no
reference path is forced, and the decode kernel takes the model's dtype, head_dim, head grouping,
KV cache dtype and block size.
"""

from __future__ import annotations

import logging

import torch

from deepinfer.core.errors import DeepInferError

logger = logging.getLogger(__name__)


def native_unavailable_reason(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                              head_dim: int, kv_storage_dtype: torch.dtype, block_size: int) -> str | None:
    """Why the native backend cannot serve this model on `device` (None when it can)."""
    if device.type != "cuda":
        return f"device is {device.type}, the kernels need a CUDA GPU"
    from deepinfer.core.ops.paged_attention import decode_attention_unavailable_reason

    return decode_attention_unavailable_reason(device, dtype, num_heads, num_kv_heads, head_dim, kv_storage_dtype,
                                               block_size)


def prefill_tile_tokens(backend, device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                        head_dim: int, kv_storage_dtype: torch.dtype, block_size: int) -> int | None:
    """Query tokens a tile of paged_prefill_attention holds, where the native backend runs and that kernel serves
    this model (head_dim 64 or 128, at most 16 query heads a KV head, any cache dtype the decode kernel reads);
    else None, and graphed steps attend every token on the decode kernel. The reason is logged once."""
    if getattr(backend, "name", None) != "native":
        return None
    from deepinfer.core.ops import paged_attention

    return paged_attention.prefill_tile_tokens(device, dtype, num_heads, num_kv_heads, head_dim, kv_storage_dtype,
                                               block_size)


def choose_attention_backend(requested: str, device: torch.device, dtype: torch.dtype, spec,
                             kv_storage_dtype: torch.dtype, block_size: int):
    """-> a backend instance for `model.attention_backend`. DeepInferError when "native" cannot serve."""
    from deepinfer.core.attention.torch_backend import TorchPagedAttention

    if requested == "torch":
        return TorchPagedAttention()
    reason = native_unavailable_reason(device, dtype, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                                       kv_storage_dtype, block_size)
    if reason is None:
        from deepinfer.core.attention.native_backend import NativePagedAttention

        return NativePagedAttention()
    if requested == "native":
        raise DeepInferError(f"attention_backend 'native' cannot serve this model: {reason}; "
                             f"use 'auto' or 'torch'")
    logger.info("attention backend: torch reference (native unavailable: %s)", reason)
    return TorchPagedAttention()


def kernel_summary(device: torch.device) -> dict:
    """{available, unavailable_reason, ops}: whether the CUDA kernels can run here, and which path every op that
    has run took (core/ops/dispatch.py: kernel_summary)."""
    from deepinfer.core.ops import dispatch

    return dispatch.kernel_summary(device)
