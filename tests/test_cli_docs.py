"""docs/CLI.md's engine-flag table is the table deepinfer_cli/options.py builds the flags from."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from deepinfer.cli import options
from deepinfer.core.config import EngineConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "CLI.md"
BEGIN, END = "<!-- engine-flags:begin -->", "<!-- engine-flags:end -->"


def engine_flag_rows() -> list[str]:
    rows = ["| flag | default | on | meaning |", "| --- | --- | --- | --- |"]
    for field in dataclasses.fields(EngineConfig):
        flag = options.ENGINE_FLAGS[field.name]
        if not flag.commands:  # set through other flags (the sampling flags), documented with them
            continue
        name = options.flag_name(field.name)
        shown = f"`{name}` / `--no-{name[2:]}`" if field.type == "bool" else f"`{name}`"
        default = flag.default_text or ("" if field.default is None else str(field.default))
        where = "all" if flag.commands == options.ENGINE_COMMANDS else ", ".join(flag.commands)
        rows.append(f"| {shown} | {default} | {where} | {flag.help} |")
    return rows


def test_the_docs_engine_flag_table_matches_the_code():
    text = DOC.read_text()
    table = text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip().splitlines()
    expected = engine_flag_rows()
    assert table == expected, "docs/CLI.md is out of date; its table should read:\n" + "\n".join(expected)
