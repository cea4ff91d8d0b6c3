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
    logits_indices: torch.Tensor  # [num_reqs] int64, batch row -> its last token
    sample_positions: torch.Tensor  # [num_reqs] int64, seq_lens: where each row's sampled token goes
    attn: AttentionMetadata


# The step's host arrays, packed for one upload: int64 segments of S rows each, in _WIDE's order, then int32
# query_start_loc [S + 1], seq_lens [S] and decode_order [S] (rounded up to whole int64s). The rows past the
# batch's are filled as the CUDA graphs' padding reads them: query starts at the token count (empty rows), one
# key a row, and last in the order (so that any S' >= the batch's rows leaves decode_order[:S'] a permutation).
_WIDE = ("idx_mapping", "sample_rows", "logits_indices", "sample_positions")


def _packed_len(S: int) -> int:  # int64 elements
    return len(_WIDE) * S + (3 * S + 2) // 2


def _pack(S: int, idx_mapping, query_start_loc, seq_lens, sample_rows) -> np.ndarray:
    """The host array for S rows a segment (S >= the batch's rows)."""
    n, W = len(idx_mapping), len(_WIDE) * S
    host = np.zeros(_packed_len(S), dtype=np.int64)
    wide = host[:W].reshape(len(_WIDE), S)
    for row, values in zip(wide, (idx_mapping, sample_rows, query_start_loc[1:] - 1, seq_lens), strict=True):
        row[: len(values)] = values
    narrow = host[W:].view(np.int32)
    narrow[: n + 1], narrow[n + 1 : S + 1] = query_start_loc, query_start_loc[-1]
    narrow[S + 1 : S + 1 + n], narrow[S + 1 + n : 2 * S + 1] = seq_lens, 1
    # the longest rows first (stable: equal lengths keep batch order), then the padding rows
    narrow[2 * S + 1 : 2 * S + 1 + n] = np.argsort(-np.asarray(seq_lens, dtype=np.int64), kind="stable")
    narrow[2 * S + 1 + n : 3 * S + 1] = np.arange(n, S, dtype=np.int32)
    return host


def _views(packed: torch.Tensor, S: int) -> dict[str, torch.Tensor]:
    """packed's segments, S rows each (query_start_loc S + 1)."""
    W = len(_WIDE) * S
    narrow = packed[W:].view(torch.int32)
    views = {name: packed[i * S : (i + 1) * S] for i, name in enumerate(_WIDE)}
    views["query_start_loc"] = narrow[: S + 1]
    views["seq_lens"] = narrow[S + 1 : 2 * S + 1]
    views["decode_order"] = narrow[2 * S + 1 : 3 * S + 1]
    return views


class InputBuffers:
    """Device tensors a step's inputs are written into, kept for the engine's
    life: the CUDA graphs are captured on them (executor/cuda_graphs.py), so a
    step replays without copying its inputs in. S rows, T tokens."""

    def __init__(self, rows: int, tokens: int, max_blocks: int, device: torch.device) -> None:
        S, T = rows, tokens
        # one upload a step; until the first, every row is padding (empty, one key), as the graphs are captured
        self.packed = torch.from_numpy(_pack(S, [], np.zeros(1, np.int32), [], [])).to(device)
        self.views = _views(self.packed, S)  # the segments, made once: a step slices their leading rows
        self.query_start_loc = self.views["query_start_loc"]  # [S + 1] past the batch's rows: its token count
        self.seq_lens = self.views["seq_lens"]  # [S] past the batch's rows: 1 (one key; graph padding)
        self.decode_order = self.views["decode_order"]  # [S] rows longest first; past the batch's: themselves
        self.logits_indices = self.views["logits_indices"]  # [S] int64 row -> its last token; past the batch's: 0
        self.input_ids = torch.zeros(T, dtype=torch.long, device=device)  # [T]
        self.positions = torch.zeros(T, dtype=torch.long, device=device)  # [T]
        self.slot_mapping = torch.full((T,), -1, dtype=torch.long, device=device)  # [T] token -> cache slot
        self.block_tables = torch.zeros(S, max_blocks, dtype=torch.int32, device=device)  # [S, max_blocks]
        self.rows, self.tokens = S, T


def prepare_inputs(
    states: RequestStates, num_scheduled_tokens: dict[str, int], block_size: int, device: torch.device,
    bufs: InputBuffers | None = None,
) -> InputBatch:
    """One small host array goes to the device (slots, query starts,
    sequence lengths, sampling rows, the rows' last tokens); positions, input
    ids, the block tables and the slot mapping are derived there from slot
    state (kernels/input_prep.py). With bufs, all of it lands in those buffers
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
    S = n if bufs is None else bufs.rows
    host = _pack(S, idx_mapping_np, query_start_loc_np, seq_lens_np, sample_rows_np)
    if bufs is None:
        views, out = _views(upload(host, device), S), None
    else:
        upload_into(bufs.packed, host)
        views, out = bufs.views, (bufs.input_ids, bufs.positions, bufs.slot_mapping, bufs.block_tables)
    idx_mapping = views["idx_mapping"][:n]
    query_start_loc = views["query_start_loc"][: n + 1]

    input_ids, positions, slot_mapping, block_tables = dispatch.prepare_inputs(
        idx_mapping, query_start_loc, num_tokens, states.num_computed.gpu, states.token_ids.gpu,
        states.block_table.gpu, block_size, out)
    attn = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=views["seq_lens"][:n],
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        query_start_loc_cpu=query_start_loc_np.tolist(),
        seq_lens_cpu=seq_lens_np.tolist(),
        max_query_len=int(num_scheduled_np.max()),
        max_seq_len=int(seq_lens_np.max()),
        decode_order=views["decode_order"][:n],
    )
    return InputBatch(
        req_ids=req_ids,
        idx_mapping=idx_mapping,
        idx_mapping_np=idx_mapping_np,
        num_scheduled_np=num_scheduled_np,
        query_start_loc_np=query_start_loc_np,
        seq_lens_np=seq_lens_np,
        sample_rows=views["sample_rows"][: len(sample_rows_np)],
        sample_rows_np=sample_rows_np,
        input_ids=input_ids,
        positions=positions,
        logits_indices=views["logits_indices"][:n],
        sample_positions=views["sample_positions"][:n],
        attn=attn,
    )
