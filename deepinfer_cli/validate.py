"""`deepinfer validate-kernels`: every CUDA kernel against its torch reference on this GPU."""

from __future__ import annotations

from deepinfer_cli.errors import not_landed


def validate_kernels() -> None:
    """Check each CUDA kernel against its torch reference and write results/kernel_validation_<gpu>.json."""
    not_landed("validate-kernels", 6)
