"""`deepinfer validate-kernels` where the kernels cannot run: one line that says it needs an NVIDIA GPU with CuPy,
before anything else runs, a non-zero exit status and no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _probe(argv: list[str]) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter; afterwards it prints whether the validation package was imported."""
    code = ("import sys\n"
            "from deepinfer.cli.main import main\n"
            f"sys.argv = {['deepinfer', *argv]!r}\n"
            "try:\n    main()\nexcept SystemExit as exit:\n    code = exit.code\nelse:\n    code = 0\n"
            "print('VALIDATE_IMPORTED' if 'deepinfer.validate.run' in sys.modules else 'VALIDATE_ABSENT')\n"
            "sys.exit(code)\n")
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)


def test_without_a_usable_gpu_it_says_so_in_one_line():
    from deepinfer.cli.validate import gpu_unavailable_reason

    reason = gpu_unavailable_reason(0)
    if reason is None:
        pytest.skip("this machine has a GPU the kernels run on")
    result = _probe(["validate-kernels", "--only", "no_such_group"])  # the GPU line comes before the options' checks
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [f"error: validate-kernels needs an NVIDIA GPU with CuPy: {reason}"]
    assert result.stdout.strip() == "VALIDATE_ABSENT"


def test_each_missing_piece_has_its_reason(monkeypatch):
    import torch

    from deepinfer import kernels
    from deepinfer.cli.validate import gpu_unavailable_reason

    monkeypatch.setattr(kernels, "cuda_unavailable_reason", lambda: "CuPy is not installed")
    assert gpu_unavailable_reason(0) == "CuPy is not installed"
    monkeypatch.setattr(kernels, "cuda_unavailable_reason", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "sees no CUDA device" in gpu_unavailable_reason(0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert gpu_unavailable_reason(3) == "--device 3: torch sees 1 CUDA device(s)"
    monkeypatch.setattr(kernels, "device_unsupported_reason", lambda index: "GPU is sm_75")
    assert gpu_unavailable_reason(0) == "GPU is sm_75"
