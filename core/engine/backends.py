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


def _kernel_reason(op_name: str, device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                   head_dim: int, kv_storage_dtype: torch.dtype, block_size: int) -> str | None:
    """Why the attention kernel op `op_name` cannot serve this model on `device` (None when it can), asked with
    probe tensors of the shapes and dtypes the layers will pass (one token, one block)."""
    from deepinfer.core.ops import dispatch
    from deepinfer.kernels import registry

    query = torch.empty(1, num_heads, head_dim, dtype=dtype, device=device)
    key_cache = torch.empty(1, num_kv_heads, block_size, head_dim, dtype=kv_storage_dtype, device=device)
    op = registry.get(op_name)
    return dispatch.kernel_blocker(query, key_cache) or op.unsupported_reason(query, key_cache, num_kv_heads)


def native_unavailable_reason(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                              head_dim: int, kv_storage_dtype: torch.dtype, block_size: int) -> str | None:
    """Why the native backend cannot serve this model on `device` (None when it can)."""
    if device.type != "cuda":
        return f"device is {device.type}, the kernels need a CUDA GPU"
    return _kernel_reason("paged_decode_attention", device, dtype, num_heads, num_kv_heads, head_dim,
                          kv_storage_dtype, block_size)


def prefill_tile_tokens(backend, device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                        head_dim: int, kv_storage_dtype: torch.dtype, block_size: int) -> int | None:
    """Query tokens a tile of paged_prefill_attention holds, where the native backend runs and that kernel serves
    this model (same-dtype KV, head_dim 64 or 128, at most 16 query heads a KV head); else None, and graphed
    steps attend every token on the decode kernel. The reason is logged once."""
    if getattr(backend, "name", None) != "native":
        return None
    from deepinfer.core.ops import dispatch
    from deepinfer.kernels.paged_attention import prefill_tile_tokens as tile_tokens

    reason = _kernel_reason("paged_prefill_attention", device, dtype, num_heads, num_kv_heads, head_dim,
                            kv_storage_dtype, block_size)
    if not dispatch.use_kernel("paged_prefill_attention", reason, fallback="the decode kernel per token"):
        return None
    return tile_tokens(num_heads, num_kv_heads)


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
    """{available, unavailable_reason, ops}: whether the CUDA kernels can run here, and for every op
    that has run, "kernel" or "reference (why)" as core/ops dispatch logged it."""
    reason = f"device is {device.type}" if device.type != "cuda" else None
    if reason is None:
        from deepinfer.kernels import cuda_unavailable_reason, device_unsupported_reason

        reason = cuda_unavailable_reason() or device_unsupported_reason(device.index or 0)
    from deepinfer.core.ops import dispatch

    ops: dict[str, list[str]] = {}
    for op, why in sorted(dispatch._logged):  # the dispatch's record of each (op, reason) it logged once
        ops.setdefault(op, []).append("kernel" if not why else f"reference ({why})")
    return {"available": reason is None, "unavailable_reason": reason,
            "ops": {op: ", ".join(paths) for op, paths in ops.items()}}
