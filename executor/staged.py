"""Device tensors written from the host in batches: one scatter per tensor per step."""
from __future__ import annotations

import numpy as np
import torch


def _staged(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """The array as a tensor, in pinned memory when it is bound for a GPU."""
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.pin_memory()


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device without stalling the host: staged through
    pinned memory (torch's caching host allocator keeps the buffer until the
    copy has run), so the copy is queued like a kernel."""
    return _staged(array, device).to(device, non_blocking=True)


def upload_into(dst: torch.Tensor, array: np.ndarray) -> torch.Tensor:
    """upload() into an existing device tensor of the array's size: one queued copy."""
    return dst.copy_(_staged(array, dst.device), non_blocking=True)


class StagedTensor:
    """A device tensor [num_slots, *row] whose writes are staged on the host.

    With mirror=True, `np` mirrors the device values for the host's own
    decisions (stage() updates it at once); tensors the device itself writes
    (sampled tokens) have no mirror.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, mirror: bool = True) -> None:
        self.gpu = torch.zeros(shape, dtype=dtype, device=device)
        self.dtype = torch.empty((), dtype=dtype).numpy().dtype
        self.np = np.zeros(shape, dtype=self.dtype) if mirror else None
        self.row_size = int(np.prod(shape[1:], dtype=np.int64))
        self._index: list[np.ndarray] = []  # flat positions
        self._values: list[np.ndarray] = []

    def stage(self, slot: int, values, start: int = 0) -> None:
        values = np.asarray(values, dtype=self.dtype).reshape(-1)
        begin = slot * self.row_size + start
        if self.np is not None:
            self.np.reshape(-1)[begin : begin + values.size] = values
        self._index.append(np.arange(begin, begin + values.size, dtype=np.int64))
        self._values.append(values)

    def apply(self) -> None:
        if not self._index:
            return
        index = upload(np.concatenate(self._index), self.gpu.device)
        values = upload(np.concatenate(self._values), self.gpu.device)
        self.gpu.view(-1)[index] = values
        self._index.clear()
        self._values.clear()
