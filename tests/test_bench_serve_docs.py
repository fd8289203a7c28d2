"""docs/CLI.md's `bench serve` section names every flag the command has, and no flag it lacks."""

from __future__ import annotations

import re
from pathlib import Path

import typer.main

from deepinfer.cli.bench import app

DOC = Path(__file__).resolve().parents[1] / "docs" / "CLI.md"
SERVER_FLAGS_IN_EXAMPLES = {"--max-num-seqs"}  # inside a --serve-args example: the server's, not the benchmark's


def test_the_docs_section_and_the_command_have_the_same_flags():
    text = DOC.read_text()
    start = text.index("## `deepinfer bench serve`")
    section = text[start:text.index("\n## ", start + 1)]
    documented = set(re.findall(r"--[a-z][a-z-]*", section)) - SERVER_FLAGS_IN_EXAMPLES
    command = typer.main.get_command(app).commands["serve"]
    flags = {opt for param in command.params for opt in [*param.opts, *param.secondary_opts]
             if opt.startswith("--") and opt != "--help"}
    assert flags - documented == set(), "flags missing from docs/CLI.md"
    assert documented - flags == set(), "docs/CLI.md names flags bench serve does not have"
