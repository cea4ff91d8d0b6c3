"""A step's per-token inputs gathered from the persistent slot state: torch
reference and Triton kernel.

For batch row r (slot s = idx_mapping[r]) computing query tokens
[query_start_loc[r], query_start_loc[r + 1]), token i of the row sits at
position num_computed[s] + i; its input id is token_ids[s, position] (the
prompt, or a token a previous step sampled and wrote there on the device),
and its KV goes to cache slot block_table[s, position // block_size] *
block_size + position % block_size. Row r's block table is slot s's row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from headrace.kernels.device import pdl_args, wait_for_previous


def prepare_inputs_ref(
    idx_mapping: torch.Tensor,  # [num_reqs] int64, batch row -> slot
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    num_tokens: int,  # query_start_loc[-1], known on the host
    num_computed: torch.Tensor,  # [num_slots] int32, slot -> tokens in the cache before this step
    token_ids: torch.Tensor,  # [num_slots, max_model_len] int32
    block_table: torch.Tensor,  # [num_slots, max_blocks] int32
    block_size: int,
    out: tuple[torch.Tensor, ...] | None = None,  # buffers to write into, as prepare_inputs's
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [num_tokens] int64, positions [num_tokens] int64, slot_mapping
    [num_tokens] int64, block_tables [num_reqs, max_blocks] int32)."""
    if out is not None:
        _check_out(out, num_tokens, idx_mapping.shape[0])
        want = prepare_inputs_ref(idx_mapping, query_start_loc, num_tokens, num_computed, token_ids, block_table,
                                  block_size)
        return tuple(o[: w.shape[0]].copy_(w) for o, w in zip(out, want))
    num_reqs = idx_mapping.shape[0]
    dev = idx_mapping.device
    counts = (query_start_loc[1:] - query_start_loc[:-1]).long()
    row = torch.repeat_interleave(torch.arange(num_reqs, device=dev), counts, output_size=num_tokens)  # token -> row
    slot = idx_mapping[row]  # token -> slot
    positions = num_computed[slot].long() + torch.arange(num_tokens, device=dev) - query_start_loc[row].long()
    input_ids = token_ids[slot, positions].long()
    block_tables = block_table[idx_mapping]
    slot_mapping = block_tables[row, positions // block_size].long() * block_size + positions % block_size
    return input_ids, positions, slot_mapping, block_tables


def _check_out(out: tuple[torch.Tensor, ...], num_tokens: int, num_reqs: int) -> None:
    """prepare_inputs's out buffers must hold the batch's tokens and rows."""
    if min(o.shape[0] for o in out[:3]) < num_tokens or out[3].shape[0] < num_reqs:
        raise ValueError(f"prepare_inputs: out buffers hold fewer than the batch's {num_tokens} tokens "
                         f"or {num_reqs} rows")


# Triton: one program per batch row; it walks the row's queries and then
# copies the slot's block-table row, BLOCK entries at a time.
_BLOCK = 128


@triton.jit
def _prepare_inputs_kernel(
    idx_mapping_ptr, query_start_loc_ptr, num_computed_ptr,
    token_ids_ptr, token_ids_stride,
    block_table_ptr, block_table_stride,
    input_ids_ptr, positions_ptr, slot_mapping_ptr,
    block_tables_ptr, block_tables_stride,
    max_blocks,
    BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    start = tl.load(query_start_loc_ptr + row)
    count = tl.load(query_start_loc_ptr + row + 1) - start
    computed = tl.load(num_computed_ptr + slot)
    offs = tl.arange(0, BLOCK)
    for i in range(0, count, BLOCK):
        mask = i + offs < count
        pos = computed + i + offs  # int32
        tok = (start + i + offs).to(tl.int64)
        ids = tl.load(token_ids_ptr + slot * token_ids_stride + pos, mask=mask, other=0)
        blk = tl.load(block_table_ptr + slot * block_table_stride + pos // BLOCK_SIZE, mask=mask, other=0)
        tl.store(positions_ptr + tok, pos.to(tl.int64), mask=mask)
        tl.store(input_ids_ptr + tok, ids.to(tl.int64), mask=mask)
        tl.store(slot_mapping_ptr + tok, blk.to(tl.int64) * BLOCK_SIZE + (pos % BLOCK_SIZE).to(tl.int64), mask=mask)
    for j in range(0, max_blocks, BLOCK):
        mask = j + offs < max_blocks
        blocks = tl.load(block_table_ptr + slot * block_table_stride + j + offs, mask=mask)
        tl.store(block_tables_ptr + row.to(tl.int64) * block_tables_stride + j + offs, blocks, mask=mask)


def prepare_inputs(
    idx_mapping: torch.Tensor,  # [num_reqs] int64, batch row -> slot
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    num_tokens: int,
    num_computed: torch.Tensor,  # [num_slots] int32
    token_ids: torch.Tensor,  # [num_slots, max_model_len] int32
    block_table: torch.Tensor,  # [num_slots, max_blocks] int32
    block_size: int,
    out: tuple[torch.Tensor, ...] | None = None,  # (input_ids [>= num_tokens], positions, slot_mapping,
    # block_tables [>= num_reqs, max_blocks]): buffers whose leading rows are written and returned
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of prepare_inputs_ref: one launch instead of a dozen ops."""
    assert token_ids.stride(1) == 1 and block_table.stride(1) == 1
    assert block_size & (block_size - 1) == 0
    num_reqs = idx_mapping.shape[0]
    dev = idx_mapping.device
    if out is not None:
        _check_out(out, num_tokens, num_reqs)
        input_ids, positions, slot_mapping, block_tables = (out[0][:num_tokens], out[1][:num_tokens],
                                                            out[2][:num_tokens], out[3][:num_reqs])
    else:
        input_ids = torch.empty(num_tokens, dtype=torch.int64, device=dev)
        positions = torch.empty(num_tokens, dtype=torch.int64, device=dev)
        slot_mapping = torch.empty(num_tokens, dtype=torch.int64, device=dev)
        block_tables = torch.empty(num_reqs, block_table.shape[1], dtype=block_table.dtype, device=dev)
    if num_reqs:
        _prepare_inputs_kernel[(num_reqs,)](
            idx_mapping, query_start_loc, num_computed,
            token_ids, token_ids.stride(0),
            block_table, block_table.stride(0),
            input_ids, positions, slot_mapping,
            block_tables, block_tables.stride(0),
            block_table.shape[1],
            BLOCK_SIZE=block_size, BLOCK=_BLOCK,
        )
    return input_ids, positions, slot_mapping, block_tables


def advance_slots_ref(
    idx_mapping: torch.Tensor,  # [num_reqs] int64, batch row -> slot
    seq_lens: torch.Tensor,  # [num_reqs] int32, tokens in the cache after the step
    sample_rows: torch.Tensor,  # [num_samples] int64, the rows that sampled a token
    sampled: torch.Tensor,  # [num_reqs] int64, each row's sampled token (read at sample_rows)
    num_computed: torch.Tensor,  # [num_slots] int32, updated
    token_ids: torch.Tensor,  # [num_slots, max_model_len] int32, updated
    num_rows: torch.Tensor | None = None,  # int32 scalar: the batch's rows, the rest padding
) -> None:
    """Move each row's slot past a step: it has computed seq_lens tokens, and a
    sampling row's token goes into its slot's token ids at position seq_lens,
    where the next step's prepare_inputs reads it. With num_rows (advance_slots'),
    the rows before it, each a sampling row."""
    if num_rows is not None:
        n = int(num_rows)
        idx_mapping, seq_lens, sample_rows = idx_mapping[:n], seq_lens[:n], sample_rows[:n]
    num_computed[idx_mapping] = seq_lens
    if sample_rows.numel():
        token_ids[idx_mapping[sample_rows], seq_lens[sample_rows].long()] = sampled[sample_rows].to(token_ids.dtype)


@triton.jit(do_not_specialize=["num_samples"])
def _advance_slots_kernel(idx_mapping_ptr, seq_lens_ptr, sample_rows_ptr, sampled_ptr, num_computed_ptr,
                          token_ids_ptr, token_ids_stride, num_samples, num_rows_ptr, ROWS_ON_DEVICE: tl.constexpr,
                          PDL: tl.constexpr):
    """Program r sets row r's computed count and, if r < num_samples, writes sample r's token. With
    ROWS_ON_DEVICE the batch's rows are num_rows_ptr's count (programs past it return) and each samples."""
    wait_for_previous(PDL)
    r = tl.program_id(0)
    if ROWS_ON_DEVICE:
        num_samples = tl.load(num_rows_ptr)
        if r >= num_samples:
            return
    slot = tl.load(idx_mapping_ptr + r)
    tl.store(num_computed_ptr + slot, tl.load(seq_lens_ptr + r))
    if r < num_samples:
        row = tl.load(sample_rows_ptr + r)
        dst = tl.load(idx_mapping_ptr + row) * token_ids_stride + tl.load(seq_lens_ptr + row)
        tl.store(token_ids_ptr + dst, tl.load(sampled_ptr + row).to(token_ids_ptr.dtype.element_ty))


def advance_slots(idx_mapping, seq_lens, sample_rows, sampled, num_computed, token_ids, num_rows=None) -> None:
    """Triton version of advance_slots_ref: one launch instead of half a dozen ops. With num_rows, an int32
    device scalar (a CUDA graph's padded batch, which reads the count where input preparation wrote it),
    only rows before it are moved, and every one of them samples (sample_rows holds at least num_rows)."""
    assert token_ids.stride(1) == 1 and sample_rows.shape[0] <= idx_mapping.shape[0]
    if idx_mapping.shape[0]:
        _advance_slots_kernel[(idx_mapping.shape[0],)](
            idx_mapping, seq_lens, sample_rows, sampled, num_computed, token_ids, token_ids.stride(0),
            sample_rows.shape[0], seq_lens if num_rows is None else num_rows, ROWS_ON_DEVICE=num_rows is not None,
            **pdl_args(idx_mapping.device))
