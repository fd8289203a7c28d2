"""`deepinfer convert` stopped part way leaves nothing behind, and what a kill -9 leaves the next run
into the same OUT removes (only that, and only when its process is gone); the finished checkpoint
is synced to disk before it is renamed into place.

The interrupted runs are real `deepinfer convert SRC OUT` processes (the CLI's own entry point),
held inside layer 1 until the test signals them.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepinfer.core.weights.convert import staging
from deepinfer.core.weights.convert.run import convert_checkpoint
from deepinfer.core.weights.layered import is_layered_checkpoint

HELD_CONVERT = """
import pathlib, sys, time
from deepinfer.core.weights.convert import hf
convert_layer = hf.HFSource.convert_layer
marker = pathlib.Path(sys.argv[3])

def held(self, index, summary):
    if index == 1:
        marker.write_text("in layer 1")
        time.sleep(120)
    return convert_layer(self, index, summary)

hf.HFSource.convert_layer = held
sys.argv = ["deepinfer", "convert", sys.argv[1], sys.argv[2]]
from deepinfer.cli.main import main
main()
"""


def temp_dirs(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.tmp-*"))


def start_held_conversion(src: Path, out: Path) -> subprocess.Popen:
    marker = out.parent / f"{out.name}.held"
    process = subprocess.Popen([sys.executable, "-c", HELD_CONVERT, str(src), str(out), str(marker)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not marker.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the conversion did not reach layer 1: {process.communicate()[1][-2000:]}")
        time.sleep(0.05)
    assert len(temp_dirs(out)) == 1 and not out.exists()
    return process


@pytest.mark.parametrize(("signum", "exit_code", "message"), [
    (signal.SIGTERM, 1, "conversion stopped by SIGTERM: nothing was written"),
    (signal.SIGINT, 130, None),
])
def test_a_signalled_conversion_removes_its_temp_directory(tiny_llama_dir, tmp_path, signum, exit_code, message):
    out = tmp_path / "out"
    process = start_held_conversion(tiny_llama_dir, out)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == exit_code, stderr
    assert temp_dirs(out) == [] and not out.exists()
    if message is not None:
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert lines == [f"error: {message} to {out}, its temp directory was removed"]


def test_the_next_conversion_removes_what_a_killed_one_left(tiny_llama_dir, tmp_path, caplog):
    out = tmp_path / "out"
    process = start_held_conversion(tiny_llama_dir, out)
    process.kill()  # SIGKILL: nothing runs, the temp directory stays
    process.communicate(timeout=60)
    (left,) = temp_dirs(out)
    assert f"tmp-{process.pid}-" in left.name
    other = tmp_path / f".other.tmp-{process.pid}-abcdefgh"  # another OUT's: not ours to touch
    other.mkdir()
    with caplog.at_level(logging.WARNING, logger=staging.__name__):
        convert_checkpoint(tiny_llama_dir, out)
    assert is_layered_checkpoint(out) and temp_dirs(out) == [] and other.is_dir()
    assert any(str(left) in record.getMessage() and "killed" in record.getMessage() for record in caplog.records)


def test_temp_directories_of_running_conversions_are_kept(tmp_path):
    out = tmp_path / "out"
    running = staging.StagingDirectory(out)  # holds its lock, as a conversion in progress does
    dead_pid = subprocess.Popen([sys.executable, "-c", "pass"])  # a pid that is gone
    dead_pid.wait()
    no_lock_alive = tmp_path / f".out.tmp-{os.getpid()}-aaaaaaaa"  # made but not locked yet, owner alive
    no_lock_dead = tmp_path / f".out.tmp-{dead_pid.pid}-bbbbbbbb"
    lock_free = tmp_path / f".out.tmp-{os.getpid()}-cccccccc"  # a reused pid, but nobody holds the lock
    link = tmp_path / f".out.tmp-{dead_pid.pid}-dddddddd"
    for directory in (no_lock_alive, no_lock_dead, lock_free):
        directory.mkdir()
    (lock_free / staging.LOCK_FILE).touch()
    link.symlink_to(no_lock_alive)
    removed = staging.remove_stale_temp_dirs(out)
    assert sorted(removed) == sorted([no_lock_dead, lock_free])
    assert running.path.is_dir() and no_lock_alive.is_dir() and link.is_symlink()
    running.remove()
    assert not running.path.exists()


def test_every_file_and_directory_is_synced_before_the_rename(tiny_llama_dir, tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst) -> None:
        events.append(("rename", str(src)))
        real_rename(src, dst)

    monkeypatch.setattr(staging.os, "fsync", fsync)
    monkeypatch.setattr(staging.os, "rename", rename)
    out = tmp_path / "out"
    convert_checkpoint(tiny_llama_dir, out)
    renames = [index for index, (kind, _) in enumerate(events) if kind == "rename"]
    assert len(renames) == 1
    temp = Path(events[renames[0]][1])
    synced_before = {path for kind, path in events[:renames[0]] if kind == "fsync"}
    written = {str(temp / p.relative_to(out)) for p in out.rglob("*")} | {str(temp)}
    assert written <= synced_before, sorted(written - synced_before)
    assert ("fsync", str(tmp_path)) in events[renames[0]:]  # the parent, after the rename
