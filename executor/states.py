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

from headrace.executor.sampling_state import SamplingState
from headrace.executor.staged import StagedTensor
from headrace.step import CachedRequestData, NewRequestData


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
