"""Kernel-or-reference dispatch, shared by every op in core/ops.

An op asks `kernel_blocker(...)` whether any CUDA kernel can run on its tensors at all, adds its
own capability check (the registry's `unsupported_reason`), and calls `use_kernel(op, reason)`,
which logs the chosen path once per (op, reason) and returns True for the kernel.
`DEEPINFER_FORCE_REFERENCE=1` sends every op to its torch reference, for comparisons.
"""

from __future__ import annotations

import logging
import os

import torch

FORCE_REFERENCE_ENV = "DEEPINFER_FORCE_REFERENCE"

logger = logging.getLogger("deepinfer.ops")
_logged: set[tuple[str, str]] = set()


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
    from kernels import cuda_unavailable_reason, device_unsupported_reason

    return cuda_unavailable_reason() or (device_unsupported_reason(present[0].device.index) if present else None)


def use_kernel(op: str, reason: str | None) -> bool:
    """True when `reason` is None. Logs 'op: CUDA kernel' or 'op: torch reference (reason)' once each."""
    key = (op, reason or "")
    if key not in _logged:
        _logged.add(key)
        if reason is None:
            logger.info("%s: CUDA kernel", op)
        else:
            logger.info("%s: torch reference (%s)", op, reason)
    return reason is None


def reset_log() -> None:
    """Forget which paths were logged (tests)."""
    _logged.clear()
