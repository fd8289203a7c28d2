"""Host<->device transfers that never make the host wait for the device's queue.

A blocking copy waits for everything queued on the stream, the next step's forward included, which
would serialize host and device again (async scheduling, core/engine/worker/inflight.py). Host->device
copies go through pinned memory with non_blocking (`to_device`); device->host copies land in pinned
memory behind a CUDA event (`HostCopy`), waited for only when the values are read.
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
