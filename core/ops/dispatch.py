"""Kernel-or-reference dispatch, shared by every op in core/ops.

Each op describes a call by a case: a NamedTuple of everything its capability check reads (the devices, dtypes,
token-independent sizes, strides and alignments of its tensors), built from the tensors in one place (the op's
`*Case.of`). `decide(op, case, check)` then answers whether the kernel serves: `check(case)` runs once per
(op, case, DEEPINFER_FORCE_REFERENCE value) and every later call is one dict lookup. The check receives only the
case, so whatever it reads is part of the cache key: a new condition cannot be left out of the key.

The first answer for each (op, reason) is logged once on the "deepinfer.ops" logger and kept for
`kernel_summary`. DEEPINFER_FORCE_REFERENCE=1 sends every op to its torch reference, for comparisons.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable

import torch

FORCE_REFERENCE_ENV = "DEEPINFER_FORCE_REFERENCE"
AUTOGRAD_REASON = "autograd is recording (kernels have no backward)"

logger = logging.getLogger("deepinfer.ops")
_logged: dict[tuple[str, str], None] = {}  # (op, reason or ""), in the order first logged
_decisions: dict[tuple, str | None] = {}  # (op, forced-reference env value, case) -> reason or None


def force_reference() -> bool:
    return os.environ.get(FORCE_REFERENCE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def kernel_blocker(devices: Iterable[torch.device]) -> str | None:
    """Why no kernel can run on tensors on these devices at all (forced reference, a CPU tensor, no CuPy, an old
    GPU), or None."""
    if force_reference():
        return f"{FORCE_REFERENCE_ENV}=1"
    devices = tuple(devices)
    if any(device.type != "cuda" for device in devices):
        return "tensors are not on a CUDA device"
    from deepinfer.kernels import cuda_unavailable_reason, device_unsupported_reason

    return cuda_unavailable_reason() or (device_unsupported_reason(devices[0].index) if devices else None)


def use_kernel(op: str, reason: str | None, fallback: str = "torch reference") -> bool:
    """True when `reason` is None. Logs 'op: CUDA kernel' or 'op: <fallback> (reason)' once each; `fallback`
    names what runs instead (the torch reference, or for a fused op the separate ops it fuses)."""
    key = (op, reason or "")
    if key not in _logged:
        _logged[key] = None
        if reason is None:
            logger.info("%s: CUDA kernel", op)
        else:
            logger.info("%s: %s (%s)", op, fallback, reason)
    return reason is None


def decide(op: str, case: tuple, check: Callable[[tuple], str | None], tensors: tuple = (),
           fallback: str = "torch reference") -> bool:
    """Whether kernel op `op` serves `case`: `kernel_blocker(case.devices) or check(case)` is None, evaluated once
    per (op, case, DEEPINFER_FORCE_REFERENCE value) and logged by use_kernel. `case` is a NamedTuple whose first
    field is the tensors' devices; `check` reads nothing but the case. `tensors`: the op's tensors, which go to the
    reference while autograd records any of them (kernels have no backward)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return use_kernel(op, AUTOGRAD_REASON, fallback)
    key = (op, os.environ.get(FORCE_REFERENCE_ENV), case)
    try:
        return _decisions[key] is None
    except KeyError:
        if getattr(check, "__closure__", None):
            raise TypeError(f"{op}: a dispatch check reads only its case, not variables it closes over") from None
        why = _decisions[key] = kernel_blocker(case[0]) or check(case)
        return use_kernel(op, why, fallback)


def logged_paths() -> dict[str, list[str]]:
    """{op: ["kernel" | "<fallback reason>", ...]} for every op that has run, in the order first logged."""
    paths: dict[str, list[str]] = {}
    for op, why in _logged:
        paths.setdefault(op, []).append(why or "kernel")
    return paths


def kernel_summary(device: torch.device) -> dict:
    """{available, unavailable_reason, ops}: whether the CUDA kernels can run on `device`, and for every op that
    has run, "kernel" or "reference (why)" as decide logged it (comma-separated where an op took several paths)."""
    reason = f"device is {device.type}" if device.type != "cuda" else None
    if reason is None:
        from deepinfer.kernels import cuda_unavailable_reason, device_unsupported_reason

        reason = cuda_unavailable_reason() or device_unsupported_reason(device.index or 0)
    ops = {op: ", ".join(sorted(path if path == "kernel" else f"reference ({path})" for path in paths))
           for op, paths in sorted(logged_paths().items())}
    return {"available": reason is None, "unavailable_reason": reason, "ops": ops}


def reset_log() -> None:
    """Forget which paths were logged and the cached decisions (tests)."""
    _logged.clear()
    _decisions.clear()
