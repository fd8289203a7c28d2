"""The temp directory a conversion writes into, beside its output, and its atomic, durable commit.

`deepinfer convert SRC OUT` writes `.OUT.tmp-<pid>-<random>/` in OUT's parent and renames it to OUT
only when every file is written, so OUT either does not exist or is complete:

- the owner holds an exclusive flock on `<temp>/.lock` while it writes (released by the kernel
  when the process dies, however it dies);
- a conversion into the same OUT first removes the temp directories earlier runs left behind
  when they were killed (kill -9, power loss), and says so: only directories whose name matches
  this pattern for this OUT, owned by this user, whose lock nobody holds (or, with no lock file
  yet, whose pid is no longer running). A directory of a conversion that is still running is
  never touched;
- `commit` fsyncs every file and directory before the rename and the parent after it, so after
  a crash OUT is either absent or whole, never a directory of empty files.
SIGTERM/SIGINT are turned into exceptions by core/weights/convert/run.py, so the writer's cleanup
runs then too.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"


def temp_prefix(out: Path) -> str:
    return f".{out.name}.tmp-{os.getpid()}-"


def _temp_pattern(out: Path) -> re.Pattern:
    return re.compile(rf"\.{re.escape(out.name)}\.tmp-(\d+)-[A-Za-z0-9_]+")


class StagingDirectory:
    """A locked temp directory beside `out` (see the module docstring)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.parent = out.absolute().parent
        remove_stale_temp_dirs(out)
        self.path = Path(tempfile.mkdtemp(prefix=temp_prefix(out), dir=self.parent))
        self._lock_fd: int | None = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def files(self) -> list[Path]:
        """Every file written so far (the lock file excluded)."""
        return sorted(p for p in self.path.rglob("*") if p.is_file() and p != self.path / LOCK_FILE)

    def commit(self) -> None:
        """fsync everything, then rename the directory to `out` (atomic on one filesystem; fails if
        `out` appeared meanwhile) and fsync the parent. The lock file is removed first, while held."""
        for file in self.files():
            _fsync(file, os.O_RDONLY)
        os.unlink(self.path / LOCK_FILE)
        for directory in sorted((p for p in self.path.rglob("*") if p.is_dir()), reverse=True):
            _fsync(directory, os.O_RDONLY | os.O_DIRECTORY)
        _fsync(self.path, os.O_RDONLY | os.O_DIRECTORY)
        os.rename(self.path, self.out)
        _fsync(self.parent, os.O_RDONLY | os.O_DIRECTORY)
        self._release()

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self._release()

    def _release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def remove_stale_temp_dirs(out: Path) -> list[Path]:
    """Remove the temp directories of earlier conversions into `out` whose process is gone."""
    pattern = _temp_pattern(out)
    parent = out.absolute().parent
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or not entry.is_dir(follow_symlinks=False):
            continue
        if entry.stat(follow_symlinks=False).st_uid != os.getuid():
            continue
        pid = int(match.group(1))
        if _owner_is_running(Path(entry.path), pid):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        logger.warning("removed %s, left by an earlier conversion to %s that was killed (process %d)",
                       entry.path, out, pid)
        removed.append(Path(entry.path))
    return removed


def _owner_is_running(directory: Path, pid: int) -> bool:
    try:
        fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:  # killed before it made its lock (or committing): go by the pid
        return _pid_is_running(pid)
    except OSError:
        return True  # cannot tell: keep it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True  # held: its owner still writes
    finally:
        os.close(fd)
    return False  # nobody holds the lock: its owner is gone (a flock dies with its process)


def _pid_is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's
    return True


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
