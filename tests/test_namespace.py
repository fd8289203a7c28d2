"""The installed distribution is one namespace, `deepinfer`: the API, its version, and no stray top-level names.

The wheel test builds the distribution with pip (its build back-end, setuptools, comes from the package
registry: the only network this test uses) and reads the wheel's file list, which is what `pip install`
puts into site-packages.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                          check=False)


def test_public_api_and_version_from_outside_the_source_tree(tmp_path):
    from importlib.metadata import version

    result = _run_python(
        "import deepinfer\n"
        "from deepinfer import LLM, SamplingParams, EngineConfig\n"
        "print(deepinfer.__version__, LLM.__module__, SamplingParams.__module__)\n",
        tmp_path)
    assert result.returncode == 0, result.stderr
    printed_version, llm_module, params_module = result.stdout.split()
    assert printed_version == version("deepinfer")
    assert llm_module == "deepinfer.core.llm"
    assert params_module == "deepinfer.core.engine.sampling_params"


@pytest.mark.parametrize("name", ["core", "kernels", "deepinfer_cli", "validate"])
def test_folder_names_are_not_importable_at_top_level(tmp_path, name):
    # tmp_path as the working directory keeps the repository itself off sys.path. Another distribution may own the
    # name (transformers depends on one called `kernels`): what must not resolve to it is this checkout's folder.
    code = (f"import importlib.util, sys; spec = importlib.util.find_spec({name!r})\n"
            f"places = [] if spec is None else [spec.origin or '', *(spec.submodule_search_locations or [])]\n"
            f"sys.exit(any(place.startswith({str(REPO / name)!r}) for place in places))")
    result = _run_python(code, tmp_path)
    assert result.returncode == 0, f"{name!r} imports from the checkout: {result.stdout}{result.stderr}"


@pytest.mark.slow
def test_wheel_holds_only_the_deepinfer_package(tmp_path):
    # built from a copy, so the build leaves nothing in the checkout
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", "results", "build", "*.egg-info",
                                                                 "__pycache__", ".hypothesis", ".pytest_cache"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)],
                           capture_output=True, text=True, timeout=600, check=False)
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("deepinfer-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/", 1)[0] for name in names if not name.split("/", 1)[0].endswith(".dist-info")}
    assert top_level == {"deepinfer"}
    for expected in ("deepinfer/__init__.py", "deepinfer/core/llm.py", "deepinfer/cli/main.py",
                     "deepinfer/kernels/quant_matmul.cu", "deepinfer/kernels/common.cuh",
                     "deepinfer/configs/shapes/qwen2.5-3b.json", "deepinfer/validate/run.py"):
        assert expected in names
