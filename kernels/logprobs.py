"""Scores of chosen token ids, and ranks: torch references and Triton kernels.

compute_scores gathers, for each row, the score of each listed token id
under the row's activation: log_softmax(logits)[id] (act 0) or
sigmoid(logits[id]) (act 1). Nothing of size [rows, vocab] is materialised
but the logits themselves: the log-sum-exp is a row reduction.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ACT_LOG_SOFTMAX = 0
ACT_SIGMOID = 1


def compute_scores_ref(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    token_ids: torch.Tensor,  # [num_rows, k] int64, -1 = no token (score left 0)
    act: torch.Tensor,  # [num_rows] int32, ACT_LOG_SOFTMAX or ACT_SIGMOID
) -> torch.Tensor:  # [num_rows, k] float32
    valid = token_ids >= 0
    picked = logits.gather(-1, token_ids.clamp(min=0))
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    scores = torch.where(act[:, None] == ACT_SIGMOID, torch.sigmoid(picked), picked - lse)
    return torch.where(valid, scores, 0.0)


def token_ranks_ref(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    token_ids: torch.Tensor,  # [num_rows] int64
) -> torch.Tensor:  # [num_rows] int64, 1 = the most likely token
    picked = logits.gather(-1, token_ids[:, None])
    return (logits > picked).sum(dim=-1) + 1


def fill_token_ids_ref(
    idx_mapping: torch.Tensor,  # [num_rows] int64
    slot_ids: torch.Tensor,  # [num_slots, max_ids] int32, the slot's logprob_token_ids
    num_slot_ids: torch.Tensor,  # [num_slots] int32, how many are set
    sampled: torch.Tensor,  # [num_rows] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # ids [num_rows, 1 + max_ids] int64 (-1 padded), valid mask
    """Per row: the sampled token, then the slot's requested ids."""
    ids = slot_ids[idx_mapping].long()
    valid = torch.arange(ids.shape[1], device=ids.device)[None, :] < num_slot_ids[idx_mapping][:, None]
    ids = torch.where(valid, ids, -1)
    ids = torch.cat([sampled[:, None], ids], dim=1)
    valid = torch.cat([torch.ones(len(ids), 1, dtype=torch.bool, device=ids.device), valid], dim=1)
    return ids, valid


# Triton kernels. Each program owns one batch row and walks the vocabulary in
# blocks of _VOCAB_BLOCK; per-lane partial results are combined at the end,
# so the loop body has no cross-lane reduction.
_VOCAB_BLOCK = 1024


@triton.jit
def _compute_scores_kernel(
    logits_ptr, logits_stride,
    token_ids_ptr, token_ids_stride,
    act_ptr,
    out_ptr, out_stride,
    vocab_size, k,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_stride
    offs = tl.arange(0, BLOCK)
    # Online log-sum-exp per lane: m is the lane's running max, s its sum of
    # exp(x - m). A lane that has seen only -inf keeps m = -inf, s = 0; the
    # shift m_safe keeps every exp argument free of (-inf) - (-inf).
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab_size, BLOCK):
        x = tl.load(row_ptr + start + offs, mask=start + offs < vocab_size, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    row_max = tl.max(m, axis=0)
    max_safe = tl.where(row_max > float("-inf"), row_max, 0.0)
    lse = row_max + tl.log(tl.sum(s * tl.exp(m - max_safe), axis=0))

    kk = tl.arange(0, BLOCK_K)
    kmask = kk < k
    ids = tl.load(token_ids_ptr + row * token_ids_stride + kk, mask=kmask, other=-1)
    valid = ids >= 0
    picked = tl.load(row_ptr + tl.maximum(ids, 0), mask=kmask & valid, other=0.0).to(tl.float32)
    act = tl.load(act_ptr + row)
    e = tl.exp(-tl.abs(picked))  # in [0, 1]: no overflow for either sign
    sigmoid = tl.where(picked >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    scores = tl.where(act == 1, sigmoid, picked - lse)  # 1 = ACT_SIGMOID
    tl.store(out_ptr + row * out_stride + kk, tl.where(valid, scores, 0.0), mask=kmask)


def compute_scores(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    token_ids: torch.Tensor,  # [num_rows, k] int64, -1 = no token (score left 0)
    act: torch.Tensor,  # [num_rows] int32, ACT_LOG_SOFTMAX or ACT_SIGMOID
) -> torch.Tensor:  # [num_rows, k] float32
    """Triton version of compute_scores_ref."""
    num_rows, vocab_size = logits.shape
    k = token_ids.shape[1]
    assert logits.stride(-1) == 1 and token_ids.stride(-1) == 1
    out = torch.empty((num_rows, k), dtype=torch.float32, device=logits.device)
    if num_rows == 0 or k == 0:
        return out
    _compute_scores_kernel[(num_rows,)](
        logits, logits.stride(0),
        token_ids, token_ids.stride(0),
        act,
        out, out.stride(0),
        vocab_size, k,
        BLOCK=_VOCAB_BLOCK,
        BLOCK_K=triton.next_power_of_2(k),
    )
    return out


@triton.jit
def _token_ranks_kernel(
    logits_ptr, logits_stride,
    token_ids_ptr,
    out_ptr,
    vocab_size,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_stride
    picked = tl.load(row_ptr + tl.load(token_ids_ptr + row))
    offs = tl.arange(0, BLOCK)
    above = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab_size, BLOCK):
        # Masked lanes read -inf, which is never strictly greater.
        x = tl.load(row_ptr + start + offs, mask=start + offs < vocab_size, other=float("-inf"))
        above += (x > picked).to(tl.int32)
    tl.store(out_ptr + row, tl.sum(above, axis=0).to(tl.int64) + 1)


def token_ranks(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    token_ids: torch.Tensor,  # [num_rows] int64
) -> torch.Tensor:  # [num_rows] int64, 1 = the most likely token
    """Triton version of token_ranks_ref: 1 + the number of logits strictly above the token's."""
    num_rows, vocab_size = logits.shape
    assert logits.stride(-1) == 1
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    _token_ranks_kernel[(num_rows,)](logits, logits.stride(0), token_ids, out, vocab_size, BLOCK=_VOCAB_BLOCK)
    return out


@triton.jit
def _fill_token_ids_kernel(
    idx_mapping_ptr,
    slot_ids_ptr, slot_ids_stride,
    num_slot_ids_ptr,
    sampled_ptr,
    ids_ptr, valid_ptr, out_stride,  # ids and valid share a shape; valid is a uint8 view
    max_ids,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    n = tl.load(num_slot_ids_ptr + slot)
    col = tl.arange(0, BLOCK)  # output column; column 0 is the sampled token, column j > 0 the slot's id j - 1
    in_row = col < max_ids + 1
    listed = (col >= 1) & (col - 1 < n)
    ids = tl.load(slot_ids_ptr + slot * slot_ids_stride + col - 1, mask=in_row & listed, other=-1).to(tl.int64)
    ids = tl.where(col == 0, tl.load(sampled_ptr + row), ids)
    valid = (col == 0) | listed
    tl.store(ids_ptr + row * out_stride + col, ids, mask=in_row)
    tl.store(valid_ptr + row * out_stride + col, valid.to(tl.uint8), mask=in_row)


def fill_token_ids(
    idx_mapping: torch.Tensor,  # [num_rows] int64
    slot_ids: torch.Tensor,  # [num_slots, max_ids] int32, the slot's logprob_token_ids
    num_slot_ids: torch.Tensor,  # [num_slots] int32, how many are set
    sampled: torch.Tensor,  # [num_rows] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # ids [num_rows, 1 + max_ids] int64 (-1 padded), valid mask
    """Triton version of fill_token_ids_ref: per row, the sampled token, then the slot's requested ids."""
    num_rows = idx_mapping.shape[0]
    max_ids = slot_ids.shape[1]
    assert slot_ids.stride(-1) == 1
    ids = torch.empty((num_rows, 1 + max_ids), dtype=torch.int64, device=idx_mapping.device)
    valid = torch.empty((num_rows, 1 + max_ids), dtype=torch.bool, device=idx_mapping.device)
    if num_rows == 0:
        return ids, valid
    _fill_token_ids_kernel[(num_rows,)](
        idx_mapping,
        slot_ids, slot_ids.stride(0),
        num_slot_ids,
        sampled,
        ids, valid.view(torch.uint8), ids.stride(0),
        max_ids,
        BLOCK=triton.next_power_of_2(max_ids + 1),
    )
    return ids, valid
