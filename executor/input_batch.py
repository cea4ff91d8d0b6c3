"""This step's input batch, gathered from the persistent slots through idx_mapping."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from headrace.executor.attention import AttentionMetadata
from headrace.executor.staged import upload
from headrace.executor.states import RequestStates
from headrace.kernels import dispatch


@dataclass
class InputBatch:
    req_ids: list[str]  # batch row -> request id
    idx_mapping: torch.Tensor  # [num_reqs] int64, batch row -> slot
    idx_mapping_np: np.ndarray
    num_scheduled_np: np.ndarray  # [num_reqs] tokens each row computes
    query_start_loc_np: np.ndarray  # [num_reqs + 1]
    seq_lens_np: np.ndarray  # [num_reqs] tokens in the cache after this step
    sample_rows: torch.Tensor  # [num_samples] int64, the rows that sample a token (not prefill chunks)
    sample_rows_np: np.ndarray
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens] int64
    logits_indices: torch.Tensor  # [num_reqs] batch row -> its last token
    attn: AttentionMetadata


def prepare_inputs(
    states: RequestStates, num_scheduled_tokens: dict[str, int], block_size: int, device: torch.device
) -> InputBatch:
    """One small host array goes to the device (slots, query starts,
    sequence lengths, sampling rows); positions, input ids, the
    block tables and the slot mapping are derived there from slot state
    (kernels/input_prep.py)."""
    req_ids = list(num_scheduled_tokens)
    n = len(req_ids)
    idx_mapping_np = np.fromiter((states.req_to_slot[r] for r in req_ids), dtype=np.int64, count=n)
    num_scheduled_np = np.fromiter(num_scheduled_tokens.values(), dtype=np.int32, count=n)
    query_start_loc_np = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(num_scheduled_np, out=query_start_loc_np[1:])
    seq_lens_np = states.num_computed.np[idx_mapping_np] + num_scheduled_np
    # A row samples when it computes its request's last expected token.
    sample_rows_np = np.flatnonzero(seq_lens_np == states.num_tokens[idx_mapping_np])
    num_tokens = int(query_start_loc_np[-1])

    packed = upload(np.concatenate([idx_mapping_np, query_start_loc_np, seq_lens_np, sample_rows_np])
                    .astype(np.int32), device)
    idx_mapping = packed[:n].long()
    query_start_loc = packed[n : 2 * n + 1]
    seq_lens = packed[2 * n + 1 : 3 * n + 1]
    sample_rows = packed[3 * n + 1 :].long()

    input_ids, positions, slot_mapping, block_tables = dispatch.prepare_inputs(
        idx_mapping, query_start_loc, num_tokens, states.num_computed.gpu, states.token_ids.gpu,
        states.block_table.gpu, block_size)
    attn = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
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
        num_scheduled_np=num_scheduled_np,
        query_start_loc_np=query_start_loc_np,
        seq_lens_np=seq_lens_np,
        sample_rows=sample_rows,
        sample_rows_np=sample_rows_np,
        input_ids=input_ids,
        positions=positions,
        logits_indices=query_start_loc[1:].long() - 1,
        attn=attn,
    )
