"""The torch calls the host issues per engine step, counted by kind and by phase (`deepinfer bench host`).

On a GPU every torch call that launches work or moves data costs the host microseconds of Python,
dispatcher and driver time whatever its size, so a step's fixed host cost follows how many it issues.
A TorchDispatchMode sees every aten op below the Python API, on any device: `views` (slices, reshapes:
no device work), `copies_to_device` / `copies_to_host` (copies between the host and a device),
`kernels` (every other op: device work, a device-to-device copy included). CUDA event records and
waits are not aten ops; they are counted beside them (`events`) by wrapping torch.cuda.Event. A graph
replay is neither, and the spans given to `exclude` (the forward) are not counted at all: what is
left is what the host issues around the forward.

Counts go to the phase of the innermost span open when the op runs (`attribute`), "other" outside
every span.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = ("kernels", "copies_to_device", "copies_to_host", "views", "events")
_COPIES = {torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default}
_EVENT_CALLS = ("record", "synchronize", "wait", "query")


def _devices(value, found: set) -> None:
    if isinstance(value, torch.Tensor):
        found.add(value.device.type)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _devices(item, found)


class TorchOpCounter(TorchDispatchMode):
    """Counts ops by (phase, kind) while entered; `take()` returns them and starts again."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()  # (phase, kind) -> calls
        self._phases: list[str] = []  # open spans, innermost last
        self._paused = 0  # open excluded spans
        self._restore: list[Callable[[], None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._paused:
            self.counts[self._phase(), self._kind(func, args, kwargs)] += 1
        return func(*args, **kwargs)

    def _phase(self) -> str:
        return self._phases[-1] if self._phases else "other"

    @staticmethod
    def _kind(func, args, kwargs) -> str:
        if getattr(func, "is_view", False):
            return "views"
        if func in _COPIES:
            devices: set = set()
            _devices(args, devices)
            target = kwargs.get("device")
            if target is not None:
                devices.add(torch.device(target).type)
            if len(devices) > 1:
                to_host = (func is torch.ops.aten.copy_.default and args[0].device.type == "cpu") or (
                    func is torch.ops.aten._to_copy.default and target is not None
                    and torch.device(target).type == "cpu")
                return "copies_to_host" if to_host else "copies_to_device"
        return "kernels"

    def _wrap(self, owner, attr: str, before: Callable[[], None], after: Callable[[], None]) -> None:
        had, previous = attr in owner.__dict__, owner.__dict__.get(attr)
        function = getattr(owner, attr)

        def wrapped(*args, **kwargs):
            before()
            try:
                return function(*args, **kwargs)
            finally:
                after()

        # On a class the wrapper must be a function, so instances bind it as a method.
        setattr(owner, attr, (lambda *args, **kwargs: wrapped(*args, **kwargs)) if isinstance(owner, type) else wrapped)
        self._restore.append(lambda: setattr(owner, attr, previous) if had else delattr(owner, attr))

    def attribute(self, owner, attr: str, phase: str) -> None:
        """Count the ops of every call of `owner.attr` (an instance or a class) as `phase`, until `close`."""
        self._wrap(owner, attr, lambda: self._phases.append(phase), self._phases.pop)

    def exclude(self, owner, attr: str) -> None:
        """Count nothing inside `owner.attr` (the forward), until `close`."""

        def pause() -> None:
            self._paused += 1

        def resume() -> None:
            self._paused -= 1

        self._wrap(owner, attr, pause, resume)

    def count_cuda_events(self) -> None:
        """Count torch.cuda.Event's records and waits as `events` (outside excluded spans), until `close`."""
        counts = self.counts

        def count() -> None:
            if not self._paused:
                counts[self._phase(), "events"] += 1

        for attr in _EVENT_CALLS:
            self._wrap(torch.cuda.Event, attr, count, lambda: None)

    def take(self) -> Counter:
        taken = Counter(self.counts)
        self.counts.clear()
        return taken

    def close(self) -> None:
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()


def per_step(counts: Counter, steps: int) -> dict:
    """{"total", "device_calls" (all but views), each kind, "by_phase": {phase: calls}} per step."""
    kinds = {kind: sum(n for (_, k), n in counts.items() if k == kind) / steps for kind in KINDS}
    phases: Counter = Counter()
    for (phase, _), n in counts.items():
        phases[phase] += n
    total = sum(kinds.values())
    return {"total": total, "device_calls": total - kinds["views"], **kinds,
            "by_phase": {phase: n / steps for phase, n in sorted(phases.items())}}
