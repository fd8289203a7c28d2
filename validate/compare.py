"""The verdict of one check: a kernel's output against its reference, measured in float64.

Metrics: relative error ||out - ref|| / ||ref||, cosine similarity, max abs error; an output that is not finite
fails (the checks poison outputs with NaN before each launch, so an element the kernel never wrote fails).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

# relative-error bounds per activation dtype; cosine must be >= 1 - rel_tol**2
REL_TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass
class CheckResult:
    op: str
    case: str
    ok: bool
    rel_err: float | None = None
    cosine: float | None = None
    max_abs: float | None = None
    rel_tol: float | None = None
    detail: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def compare(op: str, case: str, out: torch.Tensor, ref: torch.Tensor, rel_tol: float) -> CheckResult:
    out64, ref64 = out.detach().double(), ref.detach().double()
    bad = int((~torch.isfinite(out64)).sum())
    if bad:
        return CheckResult(op, case, False, rel_tol=rel_tol, detail=f"{bad} non-finite outputs (unwritten?)")
    diff = out64 - ref64
    ref_norm = float(ref64.norm())
    rel = float(diff.norm()) / max(ref_norm, 1e-30)
    cosine = float((out64 * ref64).sum()) / max(float(out64.norm()) * ref_norm, 1e-30)
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    ok = rel <= rel_tol and cosine >= 1.0 - rel_tol**2
    return CheckResult(op, case, ok, rel, cosine, max_abs, rel_tol)


def guarded(op: str, case: str, fn: Callable[[], CheckResult | list[CheckResult]]) -> list[CheckResult]:
    """Run one check; an exception becomes a failed result instead of ending the run."""
    try:
        result = fn()
    except Exception as err:  # noqa: BLE001 - every failure is reported, the run goes on
        return [CheckResult(op, case, False, detail=f"{type(err).__name__}: {err}")]
    return result if isinstance(result, list) else [result]


def poisoned(shape, dtype, device) -> torch.Tensor:
    """A buffer for a kernel's output, NaN everywhere (int8 caches use -128, a code the kernels never write), so
    an element the kernel does not write fails the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def summarize(results: list[CheckResult]) -> dict:
    failed = [r for r in results if not r.ok]
    worst = max((r.rel_err for r in results if r.rel_err is not None and not math.isnan(r.rel_err)), default=None)
    return {"checks": len(results), "failed": len(failed), "worst_rel_err": worst}
