"""This step's input batch, gathered from the persistent slots through idx_mapping."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from headrace.executor.attention import AttentionMetadata
from headrace.executor.staged import upload, upload_into
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


class InputBuffers:
    """Device tensors a step's inputs are written into, kept for the engine's
    life: the CUDA graphs are captured on them (executor/cuda_graphs.py), so a
    step replays without copying its inputs in. S rows, T tokens."""

    def __init__(self, rows: int, tokens: int, max_blocks: int, device: torch.device) -> None:
        S, T = rows, tokens
        # idx_mapping [S] | query_start_loc [S + 1] | seq_lens [S] | sample_rows [S], filled by one upload
        self.packed = torch.zeros(4 * S + 1, dtype=torch.int32, device=device)
        self.query_start_loc = self.packed[S : 2 * S + 1]  # past the batch's rows: its token count (empty rows)
        self.seq_lens = self.packed[2 * S + 1 : 3 * S + 1]  # past the batch's rows: 1 (one key; graph padding)
        self.seq_lens.fill_(1)
        self.input_ids = torch.zeros(T, dtype=torch.long, device=device)  # [T]
        self.positions = torch.zeros(T, dtype=torch.long, device=device)  # [T]
        self.slot_mapping = torch.full((T,), -1, dtype=torch.long, device=device)  # [T] token -> cache slot
        self.block_tables = torch.zeros(S, max_blocks, dtype=torch.int32, device=device)  # [S, max_blocks]
        self.rows, self.tokens = S, T

    def pack(self, idx_mapping, query_start_loc, seq_lens, sample_rows) -> np.ndarray:
        """The host array of packed's layout, every segment filled to its end."""
        S, n, k = self.rows, len(idx_mapping), len(sample_rows)
        host = np.empty(4 * S + 1, dtype=np.int32)
        host[:n], host[n:S] = idx_mapping, 0
        host[S : S + n + 1], host[S + n + 1 : 2 * S + 1] = query_start_loc, query_start_loc[-1]
        host[2 * S + 1 : 2 * S + 1 + n], host[2 * S + 1 + n : 3 * S + 1] = seq_lens, 1
        host[3 * S + 1 : 3 * S + 1 + k], host[3 * S + 1 + k :] = sample_rows, 0
        return host


def prepare_inputs(
    states: RequestStates, num_scheduled_tokens: dict[str, int], block_size: int, device: torch.device,
    bufs: InputBuffers | None = None,
) -> InputBatch:
    """One small host array goes to the device (slots, query starts,
    sequence lengths, sampling rows); positions, input ids, the
    block tables and the slot mapping are derived there from slot state
    (kernels/input_prep.py). With bufs, all of it lands in those buffers
    (the batch's tensors are their leading rows) if the batch fits them;
    otherwise in new tensors."""
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

    if bufs is not None and (n > bufs.rows or num_tokens > bufs.tokens):
        bufs = None  # larger than any graph: new tensors, and the step runs eagerly
    if bufs is None:
        packed = upload(np.concatenate([idx_mapping_np, query_start_loc_np, seq_lens_np, sample_rows_np])
                        .astype(np.int32), device)
        starts = (0, n, 2 * n + 1, 3 * n + 1)
        out = None
    else:
        packed = upload_into(bufs.packed, bufs.pack(idx_mapping_np, query_start_loc_np, seq_lens_np, sample_rows_np))
        S = bufs.rows
        starts = (0, S, 2 * S + 1, 3 * S + 1)
        out = (bufs.input_ids, bufs.positions, bufs.slot_mapping, bufs.block_tables)
    idx_mapping = packed[starts[0] : starts[0] + n].long()
    query_start_loc = packed[starts[1] : starts[1] + n + 1]
    seq_lens = packed[starts[2] : starts[2] + n]
    sample_rows = packed[starts[3] : starts[3] + len(sample_rows_np)].long()

    input_ids, positions, slot_mapping, block_tables = dispatch.prepare_inputs(
        idx_mapping, query_start_loc, num_tokens, states.num_computed.gpu, states.token_ids.gpu,
        states.block_table.gpu, block_size, out)
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
