"""Kernel-or-reference dispatch, shared by every op in core/ops.

An op asks `kernel_blocker(...)` whether any CUDA kernel can run on its tensors at all, adds its
own capability check (the registry's `unsupported_reason`), and calls `use_kernel(op, reason)`,
which logs the chosen path once per (op, reason) and returns True for the kernel.
`DEEPINFER_FORCE_REFERENCE=1` sends every op to its torch reference, for comparisons.

Ops run hundreds of times per engine step, so they go through `decide(op, key, reason)`: the
checks run once per (op, key, forced-reference setting), where `key` holds everything they read
(devices, dtypes, the shapes that do not change with the token count, alignments), and every later
call with that key is one dict lookup.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

FORCE_REFERENCE_ENV = "DEEPINFER_FORCE_REFERENCE"

logger = logging.getLogger("deepinfer.ops")
_logged: set[tuple[str, str]] = set()
_decisions: dict[tuple, str | None] = {}  # (op, forced-reference env value, key) -> reason or None


def force_reference() -> bool:
    return os.environ.get(FORCE_REFERENCE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def kernel_blocker(*tensors: torch.Tensor | None) -> str | None:
    """Why no kernel can run on these tensors (forced reference, CPU tensors, no CuPy, old GPU, autograd)."""
    if force_reference():
        return f"{FORCE_REFERENCE_ENV}=1"
    present = [t for t in tensors if t is not None]
    if any(not t.is_cuda for t in present):
        return "tensors are not on a CUDA device"
    if torch.is_grad_enabled() and any(t.requires_grad for t in present):
        return "autograd is recording (kernels have no backward)"
    from deepinfer.kernels import cuda_unavailable_reason, device_unsupported_reason

    return cuda_unavailable_reason() or (device_unsupported_reason(present[0].device.index) if present else None)


def use_kernel(op: str, reason: str | None, fallback: str = "torch reference") -> bool:
    """True when `reason` is None. Logs 'op: CUDA kernel' or 'op: <fallback> (reason)' once each; `fallback`
    names what runs instead (the torch reference, or for a fused op the separate ops it fuses)."""
    key = (op, reason or "")
    if key not in _logged:
        _logged.add(key)
        if reason is None:
            logger.info("%s: CUDA kernel", op)
        else:
            logger.info("%s: %s (%s)", op, fallback, reason)
    return reason is None


def decide(op: str, key: tuple, reason: Callable[[], str | None], fallback: str = "torch reference") -> bool:
    """`use_kernel(op, reason(), fallback)`, with `reason()` (kernel_blocker + the op's own check) evaluated
    once per (op, key, DEEPINFER_FORCE_REFERENCE value). `key` must determine reason()'s answer:
    the tensors' devices, dtypes, token-independent shapes, strides and alignments it looks at.
    While autograd records nothing is cached, since the answer then depends on requires_grad."""
    if torch.is_grad_enabled():
        return use_kernel(op, reason(), fallback)
    cache_key = (op, os.environ.get(FORCE_REFERENCE_ENV), key)
    try:
        return _decisions[cache_key] is None
    except KeyError:
        why = _decisions[cache_key] = reason()
        return use_kernel(op, why, fallback)


def fused_product_inputs(op: str, x: torch.Tensor, projection: torch.nn.Module,
                         takes: Callable[[int, int, int], bool], key: tuple, tensors: tuple,
                         reason: Callable[[object], str | None]) -> tuple[torch.Tensor, object] | None:
    """Whether a W4 product with a fused epilogue (kernel op `op`) serves `projection(x)` for x [T, K]: (x in the
    weight's stored column order, the PackedWeight) where it does, None where the caller runs the separate ops.
    It serves a QuantLinear at the token counts `takes(T, K, N)` accepts, when the tensors (x, the weight and the
    op's own `tensors`) can run kernels, the plain product's kernels take the weight, and `reason(packed)` (the
    op's own check) is None; `key` holds what that check reads beyond x and the weight."""
    from deepinfer.core.quant.quant_linear import QuantLinear
    from deepinfer.kernels import registry

    if not isinstance(projection, QuantLinear):
        return None
    packed = projection.packed
    if not takes(x.shape[0], packed.in_features, packed.out_features):
        return None
    signature = (x.device, x.dtype, packed.qweight.device, packed.bits, packed.group_size, packed.in_features,
                 packed.out_features, packed.scales.dtype, packed.qweight.data_ptr() % 16) + key
    if not decide(op, signature, lambda: (
            kernel_blocker(x, packed.qweight, *tensors)
            or registry.get("quant_matmul").unsupported_reason(x, packed.qweight, packed.scales, packed.zeros,
                                                                packed.bits, packed.group_size)
            or reason(packed)), fallback="separate ops"):
        return None
    if packed.input_perm is not None:
        x = x.index_select(1, packed.input_perm)  # stored column j multiplies x[input_perm[j]]
    return x, packed


def reset_log() -> None:
    """Forget which paths were logged and the cached decisions (tests)."""
    _logged.clear()
    _decisions.clear()
