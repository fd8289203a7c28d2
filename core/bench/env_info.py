"""The environment a result was measured in: every results JSON carries this block.

GPU name, driver, torch / CUDA / CuPy / NVRTC versions, git commit, the exact command and the
environment variables that change which code runs (`settings`; a command line alone does not show
them). The git
commit is DEEPINFER_GIT_COMMIT when set (whoever copied the tree to a GPU machine names the commit it
came from: a copy may carry no .git, or a stale one), else `git rev-parse` of the checkout, else
"unknown".
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch

GIT_COMMIT_ENV = "DEEPINFER_GIT_COMMIT"
# Variables that choose the code a run measures: DEEPINFER_PDL=0 serializes every kernel launch
# (kernels/programmatic_launch.py), DEEPINFER_FORCE_REFERENCE=1 sends every op to torch (core/ops/dispatch.py),
# DEEPINFER_CPU_WEIGHTS picks the CPU layout of packed weights (core/ops/quant_matmul_cpu.py).
# Only these are recorded: other DEEPINFER_* variables may hold secrets (DEEPINFER_API_KEY).
RUN_SETTINGS = ("DEEPINFER_PDL", "DEEPINFER_FORCE_REFERENCE", "DEEPINFER_CPU_WEIGHTS")
_REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str]) -> str | None:
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=10, cwd=_REPO_ROOT, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def git_commit() -> str:
    named = os.environ.get(GIT_COMMIT_ENV)
    if named:
        return named
    commit = _run(["git", "rev-parse", "HEAD"])
    if commit:
        dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
        return commit + ("-dirty" if dirty else "")
    return "unknown"


def _cupy_info() -> dict:
    try:
        import cupy
    except ImportError:
        return {"cupy": None}
    info = {"cupy": cupy.__version__}
    try:
        info["cupy_cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        info["cuda_driver_api"] = cupy.cuda.runtime.driverGetVersion()
        major, minor = cupy.cuda.nvrtc.getVersion()
        info["nvrtc"] = f"{major}.{minor}"
    except (RuntimeError, OSError, AttributeError) as err:
        info["cupy_error"] = str(err)
    return info


def env_info(command: list[str] | None = None) -> dict:
    """A JSON-ready description of this machine, software and command."""
    info: dict = {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(command if command is not None else sys.argv),
        "git_commit": git_commit(),
        "settings": {name: os.environ[name] for name in RUN_SETTINGS if name in os.environ},
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        device = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(device)
        info.update({
            "gpu": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "driver": _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        })
    else:
        info["gpu"] = None
    info.update(_cupy_info())
    return info


def gpu_slug(info: dict) -> str:
    """'nvidia_h200' from 'NVIDIA H200': a file-name part naming the GPU."""
    name = info.get("gpu") or "cpu"
    return "".join(ch if ch.isalnum() else "_" for ch in name.lower()).strip("_")
