"""The engine's state for /health, read on the engine thread so it is never torn.

The scheduler and the block pool change only on the engine thread, in the middle of a step; read
from the event loop, the numbers can disagree with each other (more running requests than
max_num_seqs, used + free != total). So the engine thread itself takes the snapshot, after a step
(a stats listener): at most one every `interval_s` while requests run, and always after a step
that leaves the engine idle, so an idle engine is reported exactly. /health serves the latest one.
"""

from __future__ import annotations

import time

SNAPSHOT_INTERVAL_S = 0.05  # LLMEngine.health() costs tens of microseconds; a decode step a few milliseconds


class HealthSnapshots:
    def __init__(self, engine, interval_s: float = SNAPSHOT_INTERVAL_S):
        """`engine`: an AsyncEngine or EngineCoreClient not started yet (so the first snapshot is consistent
        too); the client's `read_health` is the snapshot its engine process took after its latest step."""
        self._read_health = engine.read_health
        self._interval_s = interval_s
        self._latest = self._read_health()
        self._taken_at = time.monotonic()

    def on_step(self, stats) -> None:
        """A stats listener: runs on the engine thread after every step."""
        now = time.monotonic()
        idle = stats.num_running == 0 and stats.num_waiting == 0
        if idle or now - self._taken_at >= self._interval_s:
            self._latest = self._read_health()  # one assignment: readers see the old or the new dict
            self._taken_at = now

    @property
    def latest(self) -> dict:
        return self._latest
