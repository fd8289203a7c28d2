"""results/ holds what the docs and the code cite, and nothing they cite is missing from it.

Every `results/<file>` named in README.md, docs/*.md or the product's sources (core/, kernels/, validate/,
deepinfer_cli/) must be a file in the tree, and every file under results/ must be named there: a renamed or
deleted result cannot leave a dangling citation, and results/ keeps no file nothing reads. Names with a
placeholder (`results/kernel_validation_<gpu>.json`) are patterns, not citations. scripts/ name the files they
write, which need not exist, so they are not read. A citation `COMMIT:results/FILE` names a file in git history
(a superseded run, an experiment) that must exist at that commit and not in the tree, which keeps results/ to
the current results.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CITING = ("README.md", "docs", "core", "kernels", "validate", "deepinfer_cli")
CITATION = re.compile(r"(?:\b([0-9a-f]{7,40}):)?"
                      r"results/((?:[A-Za-z0-9_.+-]+/)*[A-Za-z0-9_.+-]+\.(?:json|txt|log))(?![A-Za-z0-9_<*]|\.[A-Za-z0-9])")
MAX_FILES = 25  # results/ is for the current results; history keeps the rest
SOURCES = (".md", ".py", ".cu", ".cuh", ".sh")


def tracked(*paths: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--", *paths], cwd=REPO, capture_output=True, text=True, check=True)
    return [REPO / line for line in out.stdout.splitlines()]


def citations(in_history: bool = False) -> dict[str, list[str]]:
    """{results/ path cited: ["file:line", ...]}; with `in_history`, {"COMMIT:results/path": [...]} instead."""
    cited: dict[str, list[str]] = {}
    for path in tracked(*CITING):
        if path.suffix not in SOURCES or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in CITATION.finditer(line):
                commit, name = match.groups()
                if (commit is not None) == in_history:
                    key = f"{commit}:results/{name}" if in_history else name
                    cited.setdefault(key, []).append(f"{path.relative_to(REPO)}:{number}")
    return cited


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def tree() -> tuple[dict[str, list[str]], set[str]]:
    if not (REPO / ".git").exists():
        pytest.skip("needs the git checkout (the file lists come from git ls-files)")
    return citations(), {str(path.relative_to(REPO / "results")) for path in tracked("results")}


def test_results_holds_a_bounded_set_of_files(tree):
    _, files = tree
    assert len(files) <= MAX_FILES, f"{len(files)} files under results/: cite superseded ones from git history"


def test_every_file_cited_from_history_exists_there_and_not_in_the_tree(tree):
    _, files = tree
    cited = citations(in_history=True)
    absent = {}
    for revision_path, where in cited.items():
        commit, path = revision_path.split(":", 1)
        if git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
            pytest.skip(f"commit {commit} is not in this clone (a shallow one?)")
        if git("cat-file", "-e", revision_path).returncode != 0:
            absent[revision_path] = where
        assert path.removeprefix("results/") not in files, f"{revision_path} is in the tree: cite it as {path}"
    assert not absent, f"cited from git history but not there: {absent}"


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
    found = [m.groups() for m in CITATION.finditer(
        "`results/w4_gemm_sweep_nvidia_h200.json`, results/kernel_validation_<gpu>.json, (results/a/b.txt) "
        "results/bench_<kind>_<model>.json results/x.json.gz, ends results/c.log, `e0c504d:results/d.txt` "
        "../results/e.json")]
    assert found == [(None, "w4_gemm_sweep_nvidia_h200.json"), (None, "a/b.txt"), (None, "c.log"),
                     ("e0c504d", "d.txt"), (None, "e.json")]
