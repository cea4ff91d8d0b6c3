"""This step's input batch, gathered from the persistent slots through idx_mapping."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from headrace.executor.attention import AttentionMetadata
from headrace.executor.states import RequestStates


@dataclass
class InputBatch:
    req_ids: list[str]  # batch row -> request id
    idx_mapping: torch.Tensor  # [num_reqs] int64, batch row -> slot
    idx_mapping_np: np.ndarray
    num_scheduled: torch.Tensor  # [num_reqs] int32
    num_scheduled_np: np.ndarray
    query_start_loc_np: np.ndarray  # [num_reqs + 1]
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens] int64
    logits_indices: torch.Tensor  # [num_reqs] batch row -> its last token
    seq_lens_np: np.ndarray  # [num_reqs]
    attn: AttentionMetadata


def prepare_inputs(
    states: RequestStates, num_scheduled_tokens: dict[str, int], block_size: int, device: torch.device
) -> InputBatch:
    """Three small host arrays go to the device; positions, input ids, the
    block tables and the slot mapping are derived there from slot state."""
    req_ids = list(num_scheduled_tokens)
    idx_mapping_np = np.fromiter((states.req_to_slot[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
    num_scheduled_np = np.fromiter(num_scheduled_tokens.values(), dtype=np.int32, count=len(req_ids))
    query_start_loc_np = np.zeros(len(req_ids) + 1, dtype=np.int32)
    np.cumsum(num_scheduled_np, out=query_start_loc_np[1:])
    seq_lens_np = states.num_computed.np[idx_mapping_np] + num_scheduled_np
    num_tokens = int(query_start_loc_np[-1])

    idx_mapping = torch.from_numpy(idx_mapping_np).to(device, non_blocking=True)
    num_scheduled = torch.from_numpy(num_scheduled_np).to(device, non_blocking=True)
    query_start_loc = torch.from_numpy(query_start_loc_np).to(device, non_blocking=True)

    row = torch.repeat_interleave(torch.arange(len(req_ids), device=device), num_scheduled.long(),
                                  output_size=num_tokens)  # token -> batch row
    slot = idx_mapping[row]  # token -> slot
    offset = torch.arange(num_tokens, device=device) - query_start_loc[row].long()
    positions = states.num_computed.gpu[slot].long() + offset
    input_ids = states.token_ids.gpu[slot, positions].long()
    block_tables = states.block_table.gpu[idx_mapping]  # [num_reqs, max_blocks_per_req]
    slot_mapping = block_tables[row, positions // block_size].long() * block_size + positions % block_size
    attn = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=torch.from_numpy(seq_lens_np.astype(np.int32)).to(device, non_blocking=True),
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        query_start_loc_cpu=query_start_loc_np.tolist(),
        seq_lens_cpu=seq_lens_np.tolist(),
        max_query_len=int(num_scheduled_np.max()),
        max_seq_len=int(seq_lens_np.max()),
    )
    return InputBatch(
        req_ids=req_ids,
        idx_mapping=idx_mapping,
        idx_mapping_np=idx_mapping_np,
        num_scheduled=num_scheduled,
        num_scheduled_np=num_scheduled_np,
        query_start_loc_np=query_start_loc_np,
        input_ids=input_ids,
        positions=positions,
        logits_indices=query_start_loc[1:].long() - 1,
        seq_lens_np=seq_lens_np,
        attn=attn,
    )
