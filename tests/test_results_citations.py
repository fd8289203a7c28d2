"""results/ holds what the docs and the code cite, and nothing they cite is missing from it.

Every `results/<file>` named in README.md, docs/*.md or the product's sources (core/, kernels/, validate/,
deepinfer_cli/) must be a file in the tree, and every file under results/ must be named there: a renamed or
deleted result cannot leave a dangling citation, and results/ keeps no file nothing reads. Names with a
placeholder (`results/kernel_validation_<gpu>.json`) are patterns, not citations. scripts/ name the files they
write, which need not exist, so they are not read.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CITING = ("README.md", "docs", "core", "kernels", "validate", "deepinfer_cli")
CITATION = re.compile(r"results/((?:[A-Za-z0-9_.+-]+/)*[A-Za-z0-9_.+-]+\.(?:json|txt|log))(?![A-Za-z0-9_<*]|\.[A-Za-z0-9])")
SOURCES = (".md", ".py", ".cu", ".cuh", ".sh")


def tracked(*paths: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--", *paths], cwd=REPO, capture_output=True, text=True, check=True)
    return [REPO / line for line in out.stdout.splitlines()]


def citations() -> dict[str, list[str]]:
    """{results/ path cited: ["file:line", ...]}"""
    cited: dict[str, list[str]] = {}
    for path in tracked(*CITING):
        if path.suffix not in SOURCES or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in CITATION.finditer(line):
                cited.setdefault(match.group(1), []).append(f"{path.relative_to(REPO)}:{number}")
    return cited


@pytest.fixture(scope="module")
def tree() -> tuple[dict[str, list[str]], set[str]]:
    if not (REPO / ".git").exists():
        pytest.skip("needs the git checkout (the file lists come from git ls-files)")
    return citations(), {str(path.relative_to(REPO / "results")) for path in tracked("results")}


def test_every_cited_results_file_exists(tree):
    cited, files = tree
    missing = {name: where for name, where in cited.items() if name not in files}
    assert not missing, f"cited but not under results/: {missing}"


def test_every_results_file_is_cited(tree):
    cited, files = tree
    assert files, "results/ is empty"
    uncited = sorted(files - set(cited))
    assert not uncited, f"under results/ but cited by no doc or source: {uncited}"


def test_a_citation_is_read_up_to_its_extension():
    found = [m.group(1) for m in CITATION.finditer(
        "`results/w4_gemm_sweep_nvidia_h200.json`, results/kernel_validation_<gpu>.json, (results/a/b.txt) "
        "results/bench_<kind>_<model>.json results/x.json.gz, ends results/c.log.")]
    assert found == ["w4_gemm_sweep_nvidia_h200.json", "a/b.txt", "c.log"]
