"""Host<->device transfers that never make the host wait for the device's queue.

A blocking copy waits for everything queued on the stream, the next step's forward included, which
would serialize host and device again (async scheduling, core/engine/worker/inflight.py). Host->device
copies go through pinned memory with non_blocking (`to_device`); device->host copies land in pinned
memory behind a CUDA event (`HostCopy`), waited for only when the values are read. The sampled tokens
of every step go back through `HostSlots`: a few pinned buffers and events made once and reused in
turn, so a step's copy back allocates nothing and creates no event.
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor, without waiting for the device's queue."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    # The caching host allocator keeps the pinned block until the copy has read it.
    return tensor.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Device tensors copied to host memory in the background; `get` waits for the copy."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._event = None
        if all(tensor.device.type == "cpu" for tensor in tensors):
            self._host = tensors  # nothing to copy: their values are final once computed
            return
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, tensor in zip(self._host, tensors):
            host.copy_(tensor, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def get(self) -> list[torch.Tensor]:
        """Thread-safe: the grammar-mask worker reads the step in flight's tokens beside the engine thread."""
        event = self._event
        if event is not None:
            event.synchronize()
            self._event = None
        return self._host


class SlotCopy:
    """A tensor copied into one of HostSlots' buffers; `get` waits for the copy (HostCopy's interface)."""

    def __init__(self, host: torch.Tensor, event) -> None:
        self._host, self._event, self._read = [host], event, False

    def get(self) -> list[torch.Tensor]:
        """Waits for the copy. The values are the slot's until its next use: readers take them at once."""
        event = self._event
        if event is not None:
            event.synchronize()
            self._event = None
        self._read = True
        return self._host

    def release(self) -> None:
        """Take the values off the slot if no one has read them yet (waiting for the copy): the slot is about
        to be reused."""
        if not self._read:
            self._host = [self.get()[0].clone()]
            self._read = False  # still to be read, now from its own memory


class HostSlots:
    """`slots` host buffers (pinned on CUDA) that device tensors are copied into in turn, each behind its own
    reused CUDA event. A copy into a slot first releases the slot's last copy (a reader that has not read it
    yet gets its values kept apart), so no copy overwrites values still to be read. The engine reads a step's
    tokens before it launches the step after next, so two slots would do; a few more keep a caller that
    samples several times before reading from ever waiting."""

    def __init__(self, dtype: torch.dtype, device: torch.device, slots: int = 4) -> None:
        self.device = device
        self._dtype, self._pin = dtype, device.type == "cuda"
        self._buffers: list[torch.Tensor] = []
        self._events = [torch.cuda.Event() if self._pin else None for _ in range(slots)]
        self._copies: list[SlotCopy | None] = [None] * slots
        self._next = 0

    def copy(self, tensor: torch.Tensor) -> SlotCopy:
        """Start copying the 1-d `tensor` into the next slot (grown to fit it: rarely, a pinned allocation)."""
        size = tensor.shape[0]
        if not self._buffers or self._buffers[0].shape[0] < size:
            self._release_all()
            capacity = max(256, 1 << (size - 1).bit_length())
            self._buffers = [torch.empty(capacity, dtype=self._dtype, pin_memory=self._pin) for _ in self._events]
        slot = self._next
        self._next = (slot + 1) % len(self._events)
        last = self._copies[slot]
        if last is not None:
            last.release()
        host, event = self._buffers[slot][:size], self._events[slot]
        host.copy_(tensor, non_blocking=self._pin)
        if event is not None:
            event.record()
        copy = self._copies[slot] = SlotCopy(host, event)
        return copy

    def _release_all(self) -> None:
        for copy in self._copies:
            if copy is not None:
                copy.release()
        self._copies = [None] * len(self._events)
