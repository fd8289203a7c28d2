"""One set of engine flags: every EngineConfig field is a flag of chat, serve, bench concurrency and
bench jitter (where it applies), with the field's name, default None, and EngineConfig's defaults only."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import typer

from deepinfer.cli import options
from deepinfer.cli.main import app
from deepinfer.core.config import EngineConfig

FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
# Where a field is not a flag, and why (written out here, independently of options.py's table).
# override_generation_config is given by the sampling flags (--temperature, ...) of chat and serve.
NOT_FLAGS = {
    "chat": {"dummy_weights", "shape", "seed", "override_generation_config"},  # chat needs real weights; its --seed seeds sampling
    "serve": {"override_generation_config"},
    "concurrency": {"override_generation_config"},
    "jitter": {"max_num_batched_tokens", "override_generation_config"},  # swept by --chunk-sizes
}
COMMAND_PATHS = {"chat": ["chat"], "serve": ["serve"], "concurrency": ["bench", "concurrency"],
                 "jitter": ["bench", "jitter"]}


def _click_command(path: list[str]):
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return command


def _engine_options(command) -> dict:
    return {p.name: p for p in command.params if p.param_type_name == "option" and p.name in FIELDS}


@pytest.mark.parametrize("name", list(COMMAND_PATHS))
def test_each_command_has_every_engine_field_that_applies_as_a_flag(name):
    command = _click_command(COMMAND_PATHS[name])
    flags = _engine_options(command)
    if name == "chat":
        assert "Sampling seed" in flags.pop("seed").help  # chat's own --seed, not EngineConfig.seed
    assert set(flags) == FIELDS - NOT_FLAGS[name]
    for field, option in flags.items():
        assert "--" + field.replace("_", "-") in option.opts  # the field's own name
        assert option.default is None  # nothing restated: EngineConfig holds every default
        if option.is_flag:
            assert option.secondary_opts == ["--no-" + field.replace("_", "-")]


def test_a_new_engine_config_field_without_a_flag_fails_loudly():
    fields = [(f.name, f.type, f) for f in dataclasses.fields(EngineConfig)]
    grown = dataclasses.make_dataclass("GrownConfig", [*fields, ("speculative_tokens", int, dataclasses.field(default=0))])
    with pytest.raises(RuntimeError, match="missing \\['speculative_tokens'\\]"):
        options.check_table(grown)
    options.check_table(EngineConfig)


@pytest.mark.parametrize(("name", "args"), [
    ("chat", ["--prompt", "hi"]),
    ("serve", []),
    ("concurrency", []),
    ("jitter", ["--chunk-sizes", "8,16,32,64"]),
])
def test_only_the_flags_given_reach_engine_config(name, args, monkeypatch, tmp_path):
    from typer.testing import CliRunner

    seen = {}

    class Stop(Exception):
        pass

    def recording_config(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(options, "EngineConfig", recording_config)
    given = ["--model", str(tmp_path), "--max-num-seqs", "8", "--no-async-scheduling", "--kv-cache-memory", "1GiB",
             "--quantization", "w4a16"]
    result = CliRunner().invoke(app, [*COMMAND_PATHS[name], *given, *args])
    assert isinstance(result.exception, Stop), result.output
    expected = {"model": str(tmp_path), "max_num_seqs": 8, "async_scheduling": False, "kv_cache_memory": "1GiB",
                "quantization": "w4a16"}
    if name == "jitter":
        expected["max_num_batched_tokens"] = 64  # the largest chunk size of the sweep
    assert seen == expected


def _help(path: list[str]) -> str:
    result = subprocess.run([sys.executable, "-m", "deepinfer", *path, "--help"], check=False, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("path", [*COMMAND_PATHS.values(), ["convert"], ["bench", "gemv"], ["validate-kernels"]])
def test_help_fits_80_columns_with_every_option_name_whole(path):
    text = _help(path)
    assert max(len(line) for line in text.splitlines()) <= 80, text
    for param in _click_command(path).params:
        for opt in [*param.opts, *param.secondary_opts]:
            if opt.startswith("-"):
                assert opt in text.split() or f"{opt}," in text.split(), f"{opt} is not whole in\n{text}"


def test_on_off_flags_read_as_flags():
    text = _help(["serve"])
    assert "--enforce-eager / --no-enforce-eager\n" in text
    assert "--enable-prefix-caching / --no-enable-prefix-caching\n" in text
    assert "[default: 2048]" in text and "[default: on]" in text  # EngineConfig's defaults, shown


def test_version_is_the_package_version():
    import deepinfer

    result = subprocess.run([sys.executable, "-m", "deepinfer", "--version"], check=False, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0
    assert result.stdout == f"deepinfer {deepinfer.__version__}\n"
