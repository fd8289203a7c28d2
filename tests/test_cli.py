"""The `deepinfer` command as a user runs it: instant help, one-shot chat, one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

DEEPINFER = [sys.executable, "-m", "deepinfer"]


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*DEEPINFER, *args], check=False, capture_output=True, text=True, timeout=timeout)


def test_help_lists_every_command_without_importing_torch():
    probe = (
        "import sys\n"
        "from deepinfer.cli.main import main\n"
        "sys.argv = ['deepinfer', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'TORCH_ABSENT')\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=60)
    assert "TORCH_ABSENT" in result.stdout
    for command in ("convert", "validate-kernels", "chat", "serve", "bench"):
        assert command in result.stdout
    bench = run("bench", "--help", timeout=60)
    assert bench.returncode == 0
    for command in ("concurrency", "jitter", "gemv"):
        assert command in bench.stdout


def test_one_shot_chat_answers_paris(smollm2_gguf):
    result = run("chat", "--prompt", "What is the capital of France?", "--temperature", "0",
                 "--model", str(smollm2_gguf))
    assert result.returncode == 0, result.stderr
    answer = result.stdout.strip()
    assert "Paris" in answer
    assert len(answer.splitlines()) == 1  # only the answer on stdout, logs go elsewhere


def test_one_shot_chat_on_the_default_model_answers_a_question_piped_on_stdin(smollm2_gguf):
    # No --model: the default model from the user cache (the fixture made sure it is there); stdin is
    # not a terminal, so what it holds is the one message, as with --prompt.
    result = subprocess.run([*DEEPINFER, "chat", "--temperature", "0", "--max-tokens", "16"], check=False,
                            capture_output=True, text=True, timeout=300, input="What is the capital of France?\n")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def _assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_path_is_one_line_error(tmp_path):
    missing = tmp_path / "no-such-model"
    _assert_one_line_error(run("chat", "--model", str(missing), "--prompt", "hi"), str(missing))


def test_directory_without_weights_is_one_line_error(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    _assert_one_line_error(run("chat", "--model", str(tmp_path), "--prompt", "hi"), str(tmp_path))


def test_unknown_architecture_is_one_line_error(tmp_path, tiny_llama_dir):
    model_dir = tmp_path / "mystery"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="mysterynet", architectures=["MysteryNetForCausalLM"])
    (model_dir / "config.json").write_text(json.dumps(config))
    _assert_one_line_error(run("chat", "--model", str(model_dir), "--prompt", "hi"), "MysteryNet")


def test_truncated_gguf_is_one_line_error_and_debug_shows_traceback(tmp_path, smollm2_gguf):
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_gguf, "rb") as source:
        truncated.write_bytes(source.read(4 * 1024 * 1024))
    _assert_one_line_error(run("chat", "--model", str(truncated), "--prompt", "hi"), str(truncated))
    debug = run("--debug", "chat", "--model", str(truncated), "--prompt", "hi")
    assert debug.returncode != 0
    assert "Traceback" in debug.stderr


@pytest.mark.parametrize("flag", [["--block-size", "7"], ["--dtype", "float8"]])
def test_invalid_engine_flag_is_one_line_error(flag, smollm2_gguf):
    _assert_one_line_error(run("chat", "--model", str(smollm2_gguf), "--prompt", "hi", *flag))
