"""Runs hostile cases in a fresh interpreter and reports, per case, how it ended, in how long, and how
much it grew the process's peak RSS (ru_maxrss).

A case is Python source run after `setup` (imports and a warm-up, so their memory is not counted);
the interpreter runs under an address-space limit, so a case whose protection is missing fails
with MemoryError instead of swapping the machine, and the whole probe under a timeout, so one that
would run forever fails too.
"""

from __future__ import annotations

import json
import subprocess
import sys

ADDRESS_SPACE_LIMIT = 4 << 30

_RUNNER = r"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
namespace = {{}}
exec(json.loads(sys.argv[1]), namespace)
for name, code in json.loads(sys.argv[2]):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    try:
        exec(code, dict(namespace))
        outcome = {{"error": None}}
    except BaseException as err:
        outcome = {{"error": type(err).__name__, "classes": [c.__name__ for c in type(err).__mro__],
                    "message": str(err)}}
    outcome["seconds"] = time.monotonic() - start
    outcome["rss_growth_mb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(json.dumps([name, outcome]), flush=True)
"""


def run_probe(setup: str, cases: dict[str, str], timeout: float = 120.0) -> dict[str, dict]:
    """{case name: {"error": class name or None, "classes", "message", "seconds", "rss_growth_mb"}}.
    Raises AssertionError naming the cases that had not finished when the probe died or timed out."""
    runner = _RUNNER.format(limit=ADDRESS_SPACE_LIMIT)
    try:
        done = subprocess.run([sys.executable, "-c", runner, json.dumps(setup), json.dumps(list(cases.items()))],
                              check=False, capture_output=True, text=True, timeout=timeout)
        stdout, stderr, died = done.stdout, done.stderr, done.returncode != 0
    except subprocess.TimeoutExpired as err:
        stdout = err.stdout.decode() if isinstance(err.stdout, bytes) else err.stdout or ""
        stderr, died = f"timed out after {timeout} s", True
    results = dict(json.loads(line) for line in stdout.splitlines() if line.startswith("["))
    unfinished = [name for name in cases if name not in results]
    assert not unfinished, f"probe ended before {unfinished}: {stderr[-2000:]}"
    assert not died, stderr[-2000:]
    return results
