"""MetricTallies: the numbers behind /metrics, one float64 array under one lock, private to a process
or shared by the API-server processes of one `deepinfer serve --api-server-count N`.

Each API server tallies the requests it serves (and the engine-wide figures of the steps it is
told to count, core/engine/sched/core_process.py), so a scrape of any one of them must read the
sum over all of them. The tallies therefore live in shared memory: `MetricTallies.shared(size)`
is a multiprocessing RawArray (an anonymous shared mapping) under a multiprocessing Lock, handed
to the spawned API servers as a Process argument; every process adds into the same array and
reads the totals from it. A private one (one API server, a test) is a numpy array under a
threading lock. Counters are float64, exact for integers below 2**53.

Callers hold `lock` around a group of updates (one engine step) and around a read (one scrape),
so a scrape never sees half a step. `values` (a memoryview: one number at Python speed) and `array`
(a numpy view of the same memory: many at once) are two views of the tallies.
"""

from __future__ import annotations

import multiprocessing
import threading

import numpy as np


class MetricTallies:
    def __init__(self, size: int, _raw=None, _lock=None) -> None:
        self.size = size
        self._raw = _raw
        if _raw is None:
            self.array = np.zeros(size, dtype=np.float64)
            self.lock = threading.Lock()
        else:
            self.array = np.frombuffer(_raw, dtype=np.float64, count=size)
            self.lock = _lock
        self.values = memoryview(self.array)

    @classmethod
    def shared(cls, size: int) -> MetricTallies:
        """Tallies that processes spawned with this object as an argument add into and read together."""
        context = multiprocessing.get_context("spawn")
        return cls(size, context.RawArray("d", size), context.Lock())

    @property
    def is_shared(self) -> bool:
        return self._raw is not None

    def __getstate__(self) -> dict:
        if self._raw is None:
            raise TypeError("private MetricTallies stay in their process; use MetricTallies.shared")
        return {"size": self.size, "raw": self._raw, "lock": self.lock}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["size"], state["raw"], state["lock"])
