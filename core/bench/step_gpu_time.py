"""The device time of the engine's steps, measured beside their wall time (`deepinfer bench host --forward model`).

A pair of CUDA events is recorded on the engine's stream around each launched step's device work
(`ModelRunner.launch`: input copies, forward or graph replay, sampling, the copy of the sampled tokens
back): the first event completes when the device reaches the step, the second when it is done with it,
so their distance is the device's span of that step, gaps inside it (a host that enqueues slower than
the device runs) included. Recording an event costs the host a few microseconds and makes no one wait;
the events are read only after the timed steps (`read`), where one synchronization is fine.
"""

from __future__ import annotations

from collections.abc import Callable


class StepGpuTimer:
    """Wraps `runner.launch` until `close`; `read()` -> the device seconds of each launch, in order."""

    def __init__(self, runner, event_factory: Callable[[], object], synchronize: Callable[[], None]) -> None:
        """`event_factory()`: an object with `record()` and `elapsed_time(end) -> ms` (torch.cuda.Event with
        timing); `synchronize()`: waits for the device (torch.cuda.synchronize)."""
        self._runner = runner
        self._synchronize = synchronize
        self._pairs: list[tuple[object, object]] = []
        launch = runner.launch
        pairs = self._pairs

        def timed_launch(*args, **kwargs):
            start = event_factory()
            start.record()
            try:
                return launch(*args, **kwargs)
            finally:
                end = event_factory()
                end.record()
                pairs.append((start, end))

        runner.launch = timed_launch  # an instance attribute: `close` takes it out again

    @property
    def num_launches(self) -> int:
        """Launches timed since the last `read`."""
        return len(self._pairs)

    def read(self) -> list[float]:
        """Waits for the device, then the seconds between each launch's two events; the list starts again."""
        self._synchronize()
        seconds = [start.elapsed_time(end) / 1e3 for start, end in self._pairs]
        self._pairs.clear()
        return seconds

    def close(self) -> None:
        self._runner.__dict__.pop("launch", None)


def cuda_step_timer(runner, device) -> StepGpuTimer | None:
    """A StepGpuTimer on `runner` when `device` is a CUDA device (torch's current stream there is the
    engine's), else None: on the CPU there is no separate device time."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    return StepGpuTimer(runner, lambda: torch.cuda.Event(enable_timing=True),
                        lambda: torch.cuda.synchronize(device))
