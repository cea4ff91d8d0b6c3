"""Persistent per-request state in fixed slots, written through staged writes.

A request takes a free slot when it enters the executor and keeps it until
it finishes or is preempted. Its values are written once, at admission or
when they change (new KV blocks), into host-side staging lists, and every
step applies all staged values to the device tensors with one scatter per
tensor. Nothing here is rebuilt from Python objects each step.
"""
from __future__ import annotations

import numpy as np
import torch

from headrace.core.scheduler import CachedRequestData, NewRequestData

_RANDOM_SEED_MASK = (1 << 64) - 1


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
        index = torch.from_numpy(np.concatenate(self._index)).to(self.gpu.device, non_blocking=True)
        values = torch.from_numpy(np.concatenate(self._values)).to(self.gpu.device, non_blocking=True)
        self.gpu.view(-1)[index] = values
        self._index.clear()
        self._values.clear()


class RequestStates:
    """slot -> everything the executor must know about its request."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.free_slots = list(range(max_num_reqs - 1, -1, -1))
        self.req_to_slot: dict[str, int] = {}
        t = lambda *shape, dtype, mirror=True: StagedTensor(shape, dtype, device, mirror)  # noqa: E731
        S = max_num_reqs
        self.token_ids = t(S, max_model_len, dtype=torch.int32, mirror=False)  # slot -> prompt + outputs
        self.block_table = t(S, max_blocks_per_req, dtype=torch.int32, mirror=False)  # slot -> KV block ids
        self.num_computed = t(S, dtype=torch.int32)  # slot -> tokens with KV in the cache
        # Sampling state (our SamplingMetadata), per slot.
        self.temperature = t(S, dtype=torch.float32)  # 0 = greedy
        self.top_k = t(S, dtype=torch.int32)  # 0 = off
        self.top_p = t(S, dtype=torch.float32)
        self.min_p = t(S, dtype=torch.float32)
        self.seed = t(S, dtype=torch.int64)
        self.num_logprobs = t(S, dtype=torch.int32)  # -1 = none
        self.staged = [v for v in vars(self).values() if isinstance(v, StagedTensor)]
        # Host-only counters.
        self.num_tokens = np.zeros(S, dtype=np.int64)  # slot -> known tokens
        self.num_blocks = np.zeros(S, dtype=np.int64)  # slot -> blocks in its table row

    def add(self, new: NewRequestData) -> None:
        slot = self.free_slots.pop()
        self.req_to_slot[new.req_id] = slot
        sp = new.sampling_params
        self.token_ids.stage(slot, new.token_ids)
        self.block_table.stage(slot, new.block_ids)
        self.num_tokens[slot] = len(new.token_ids)
        self.num_blocks[slot] = len(new.block_ids)
        self.num_computed.stage(slot, new.num_computed_tokens)
        self.temperature.stage(slot, sp.temperature)
        self.top_k.stage(slot, sp.top_k if sp.top_k > 0 else 0)
        self.top_p.stage(slot, sp.top_p)
        self.min_p.stage(slot, sp.min_p)
        seed = new.seed & _RANDOM_SEED_MASK
        self.seed.stage(slot, seed - (1 << 64) if seed >= 1 << 63 else seed)  # as signed int64
        self.num_logprobs.stage(slot, -1 if sp.logprobs is None else sp.logprobs)

    def update(self, cached: CachedRequestData) -> None:
        slot = self.req_to_slot[cached.req_id]
        if cached.new_block_ids:
            self.block_table.stage(slot, cached.new_block_ids, start=int(self.num_blocks[slot]))
            self.num_blocks[slot] += len(cached.new_block_ids)
        if self.num_computed.np[slot] != cached.num_computed_tokens:
            self.num_computed.stage(slot, cached.num_computed_tokens)

    def remove(self, req_id: str) -> None:
        slot = self.req_to_slot.pop(req_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def apply_staged(self) -> None:
        for tensor in self.staged:
            tensor.apply()
