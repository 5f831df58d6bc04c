"""Host-to-device staging: a pinned host buffer the engine thread fills and its device copy.

Owns the buffers and the event that marks the end of the last copy out of the host buffer.
Pinned (on CUDA) so the copy is an asynchronous DMA: a copy from pageable memory holds the host
until the device has run everything queued before it. Runs on the engine thread only.
"""

from __future__ import annotations

import math
from typing import Any

import numpy.typing as npt
import torch


class Staged:
    """`write(shape)` gives the host buffer's first elements as an array to fill, `send(shape)`
    queues their copy to the device and returns it there; the next `write` waits for that copy
    (long done, in practice) before the host overwrites what it reads."""

    def __init__(self, n_elements: int, dtype: torch.dtype, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._host = torch.zeros(n_elements, dtype=dtype, pin_memory=self._cuda)
        self._device = torch.zeros(n_elements, dtype=dtype, device=device)
        self._read: torch.cuda.Event | None = None

    def write(self, shape: tuple[int, ...]) -> npt.NDArray[Any]:
        if self._read is not None:
            self._read.synchronize()
        return self._host[: math.prod(shape)].view(shape).numpy()

    def send(self, shape: tuple[int, ...]) -> torch.Tensor:
        n = math.prod(shape)
        on_device = self._device[:n].view(shape)
        on_device.copy_(self._host[:n].view(shape), non_blocking=True)
        if self._cuda:
            self._read = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._read.record()
        return on_device
