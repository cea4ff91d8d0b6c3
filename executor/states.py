"""Persistent per-request state in fixed slots, written through staged writes.

A request takes a free slot when it enters the executor and keeps it until
it finishes or is preempted. Its values are written once, at admission or
when they change (new KV blocks), into host-side staging lists, and every
step applies all staged values to the device tensors with one scatter per
tensor. Nothing here is rebuilt from Python objects each step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from headrace.core.scheduler import CachedRequestData, NewRequestData

if TYPE_CHECKING:
    from headrace.executor.sampling_state import SamplingState


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device without stalling the host: staged through
    pinned memory (torch's caching host allocator keeps the buffer until the
    copy has run), so the copy is queued like a kernel."""
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


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


class RequestStates:
    """slot -> everything the executor must know about its request."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, device: torch.device,
                 sampling: SamplingState) -> None:
        self.max_num_reqs = max_num_reqs
        self.free_slots = list(range(max_num_reqs - 1, -1, -1))
        self.req_to_slot: dict[str, int] = {}
        t = lambda *shape, dtype, mirror=True: StagedTensor(shape, dtype, device, mirror)  # noqa: E731
        S = max_num_reqs
        self.token_ids = t(S, max_model_len, dtype=torch.int32, mirror=False)  # slot -> prompt + outputs
        self.block_table = t(S, max_blocks_per_req, dtype=torch.int32, mirror=False)  # slot -> KV block ids
        self.num_computed = t(S, dtype=torch.int32)  # slot -> tokens with KV in the cache
        self.staged = [v for v in vars(self).values() if isinstance(v, StagedTensor)]
        # Host-only counters.
        self.num_tokens = np.zeros(S, dtype=np.int64)  # slot -> known tokens
        self.num_blocks = np.zeros(S, dtype=np.int64)  # slot -> blocks in its table row
        self.sampling = sampling  # the per-slot sampling parameters

    def add(self, new: NewRequestData) -> int:
        slot = self.free_slots.pop()
        self.req_to_slot[new.req_id] = slot
        self.token_ids.stage(slot, new.token_ids)
        self.block_table.stage(slot, new.block_ids)
        self.num_tokens[slot] = len(new.token_ids)
        self.num_blocks[slot] = len(new.block_ids)
        self.num_computed.stage(slot, new.num_computed_tokens)
        self.sampling.add(slot, new.sampling_params, new.seed, new.token_ids, new.num_prompt_tokens)
        return slot

    def update(self, cached: CachedRequestData) -> None:
        slot = self.req_to_slot[cached.req_id]
        if cached.new_block_ids:
            self.block_table.stage(slot, cached.new_block_ids, start=int(self.num_blocks[slot]))
            self.num_blocks[slot] += len(cached.new_block_ids)
        if self.num_computed.np[slot] != cached.num_computed_tokens:
            self.num_computed.stage(slot, cached.num_computed_tokens)

    def remove(self, req_id: str) -> int | None:
        slot = self.req_to_slot.pop(req_id, None)
        if slot is not None:
            self.sampling.remove(slot)
            self.free_slots.append(slot)
        return slot

    def apply_staged(self) -> None:
        for tensor in self.staged:
            tensor.apply()
        self.sampling.apply_staged()

    def drop_device_tensors(self) -> None:
        """Free the device tensors, this state's and the sampling state's (the
        engine shut down); the host-side slot bookkeeping stays readable."""
        for tensor in self.staged + self.sampling.staged:
            tensor.gpu = None
