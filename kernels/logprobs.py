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
    logits: torch.Tensor,  # [num_rows, vocab] float32 or 16-bit: read as float32
    token_ids: torch.Tensor,  # [num_rows, k] int64, -1 = no token (score left 0)
    act: torch.Tensor,  # [num_rows] int32, ACT_LOG_SOFTMAX or ACT_SIGMOID
) -> torch.Tensor:  # [num_rows, k] float32
    logits = logits.float()
    valid = token_ids >= 0
    picked = logits.gather(-1, token_ids.clamp(min=0))
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    scores = torch.where(act[:, None] == ACT_SIGMOID, torch.sigmoid(picked), picked - lse)
    return torch.where(valid, scores, 0.0)


def token_ranks_ref(
    logits: torch.Tensor,  # [num_rows, vocab] float32 or 16-bit: read as float32
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
def _score(x, lse, act):
    """A logit's score: sigmoid(x) for act 1 (ACT_SIGMOID), else log_softmax, x - lse."""
    e = tl.exp(-tl.abs(x))  # in [0, 1]: no overflow for either sign
    return tl.where(act == 1, tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)), x - lse)


@triton.jit(do_not_specialize=["token_ids_stride", "out_stride", "k"])
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
    scores = _score(picked, lse, act)
    tl.store(out_ptr + row * out_stride + kk, tl.where(valid, scores, 0.0), mask=kmask)


def compute_scores(
    logits: torch.Tensor,  # [num_rows, vocab] float32 or 16-bit: read as float32
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
    picked = tl.load(row_ptr + tl.load(token_ids_ptr + row)).to(tl.float32)
    offs = tl.arange(0, BLOCK)
    above = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab_size, BLOCK):
        # Masked lanes read -inf, which is never strictly greater.
        x = tl.load(row_ptr + start + offs, mask=start + offs < vocab_size, other=float("-inf")).to(tl.float32)
        above += (x > picked).to(tl.int32)
    tl.store(out_ptr + row, tl.sum(above, axis=0).to(tl.int64) + 1)


def token_ranks(
    logits: torch.Tensor,  # [num_rows, vocab] float32 or 16-bit: read as float32
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


@triton.jit(do_not_specialize=["out_stride", "max_ids"])
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


def top_logprobs_ref(
    logits: torch.Tensor,  # [num_rows, vocab] float32 or 16-bit: read as float32
    sampled: torch.Tensor,  # [num_rows] int64
    act: torch.Tensor,  # [num_rows] int32, ACT_LOG_SOFTMAX or ACT_SIGMOID
    n: int,  # top ids per row, 0 to 20
) -> tuple[torch.Tensor, torch.Tensor]:  # ints [num_rows, n + 2] int32, floats [num_rows, n + 2] float32
    """A step's logprobs packed as the wire takes them: per row the sampled id, the
    top n ids and the sampled token's rank (ints); their scores under act, then the
    sampled token's log_softmax (floats)."""
    ids = torch.cat([sampled[:, None], logits.topk(n, dim=-1).indices], dim=1)
    scores = compute_scores_ref(logits, ids, act)
    sampled_lp = compute_scores_ref(logits, sampled[:, None], torch.zeros_like(act))[:, 0]
    ranks = token_ranks_ref(logits, sampled)
    return torch.cat([ids, ranks[:, None]], dim=1).int(), torch.cat([scores, sampled_lp[:, None]], dim=1)


# top_logprobs in two launches. Pass 1: program (row, chunk) reads CHUNK logits
# once, and writes the chunk's max, its sum of exp(x - max), how many logits
# exceed the sampled token's, and its N largest (value, id), taken in N rounds
# of max-then-lowest-id among the lanes not yet taken. Pass 2: program row
# combines them into the log-sum-exp, the rank and the row's N largest (the
# same rounds over the chunks' candidates) and writes the packed row.
_TOP_CHUNK = 2048


@triton.jit
def _top_round(values, ids, taken, valid, BIG: tl.constexpr):
    """The largest of values among valid lanes not taken (ties: the lowest id),
    its id and the lanes' taken mask with it set."""
    live = valid & ~taken
    best = tl.max(tl.where(live, values, float("-inf")), axis=0)
    pick = tl.min(tl.where(live & (values == best), ids, BIG), axis=0)
    return best, pick, taken | (ids == pick)


@triton.jit
def _top_logprobs_chunk_kernel(logits_ptr, logits_stride, sampled_ptr, part_ptr, cand_v_ptr, cand_i_ptr, vocab_size,
                               N: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    num_chunks = tl.num_programs(1)
    row_ptr = logits_ptr + row * logits_stride
    ids = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = ids < vocab_size
    x = tl.load(row_ptr + ids, mask=valid, other=float("-inf")).to(tl.float32)
    picked = tl.load(row_ptr + tl.load(sampled_ptr + row)).to(tl.float32)
    m = tl.max(x, axis=0)
    m_safe = tl.where(m > float("-inf"), m, 0.0)  # a chunk of -inf only: s = 0
    s = tl.sum(tl.exp(x - m_safe), axis=0)
    above = tl.sum((x > picked).to(tl.int32), axis=0)
    part = part_ptr + (row * num_chunks + chunk) * 3  # (max, sum, above as float32)
    tl.store(part, m)
    tl.store(part + 1, s)
    tl.store(part + 2, above.to(tl.float32))
    if N > 0:
        taken = ids < 0
        slots = tl.arange(0, BLOCK_N)
        top_v = tl.full([BLOCK_N], float("-inf"), tl.float32)
        top_i = tl.full([BLOCK_N], -1, tl.int32)
        for j in tl.static_range(N):
            best, pick, taken = _top_round(x, ids, taken, valid, 2**31 - 1)
            top_v = tl.where(slots == j, best, top_v)
            top_i = tl.where(slots == j, tl.where(pick < 2**31 - 1, pick, -1), top_i)  # -1: the chunk ran out
        out = (row * num_chunks + chunk) * N + slots
        tl.store(cand_v_ptr + out, top_v, mask=slots < N)
        tl.store(cand_i_ptr + out, top_i, mask=slots < N)


@triton.jit
def _top_logprobs_row_kernel(logits_ptr, logits_stride, sampled_ptr, act_ptr, part_ptr, cand_v_ptr, cand_i_ptr,
                             ints_ptr, floats_ptr, num_chunks, N: tl.constexpr, BLOCK_C: tl.constexpr,
                             BLOCK_CAND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    part = part_ptr + (row * num_chunks + c) * 3
    m = tl.load(part, mask=c < num_chunks, other=float("-inf"))
    s = tl.load(part + 1, mask=c < num_chunks, other=0.0)
    above = tl.sum(tl.load(part + 2, mask=c < num_chunks, other=0.0), axis=0)
    row_max = tl.max(m, axis=0)
    max_safe = tl.where(row_max > float("-inf"), row_max, 0.0)
    lse = row_max + tl.log(tl.sum(s * tl.exp(m - max_safe), axis=0))
    act = tl.load(act_ptr + row)
    token = tl.load(sampled_ptr + row)
    picked = tl.load(logits_ptr + row * logits_stride + token).to(tl.float32)
    out_i, out_f = ints_ptr + row * (N + 2), floats_ptr + row * (N + 2)
    tl.store(out_i, token.to(tl.int32))
    tl.store(out_f, _score(picked, lse, act))
    tl.store(out_i + N + 1, above.to(tl.int32) + 1)
    tl.store(out_f + N + 1, picked - lse)
    if N > 0:
        k = tl.arange(0, BLOCK_CAND)
        valid = k < num_chunks * N
        values = tl.load(cand_v_ptr + row * num_chunks * N + k, mask=valid, other=float("-inf"))
        cand_ids = tl.load(cand_i_ptr + row * num_chunks * N + k, mask=valid, other=-1)
        valid = valid & (cand_ids >= 0)
        taken = k < 0
        for j in tl.static_range(N):
            best, pick, taken = _top_round(values, k, taken, valid, 2**31 - 1)
            token_j = tl.sum(tl.where(k == pick, cand_ids, 0), axis=0)
            tl.store(out_i + 1 + j, token_j)
            tl.store(out_f + 1 + j, _score(best, lse, act))


def top_logprobs(
    logits: torch.Tensor,  # [num_rows, vocab] float32 or 16-bit: read as float32
    sampled: torch.Tensor,  # [num_rows] int64
    act: torch.Tensor,  # [num_rows] int32, ACT_LOG_SOFTMAX or ACT_SIGMOID
    n: int,  # top ids per row, 0 to 20
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of top_logprobs_ref: every logit read once."""
    num_rows, vocab_size = logits.shape
    if not 0 <= n <= vocab_size:
        raise ValueError(f"top_logprobs: n must be in [0, {vocab_size}], got {n}")
    assert logits.stride(-1) == 1
    ints = torch.empty((num_rows, n + 2), dtype=torch.int32, device=logits.device)
    floats = torch.empty((num_rows, n + 2), dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return ints, floats
    chunks = triton.cdiv(vocab_size, _TOP_CHUNK)
    part = torch.empty((num_rows, chunks, 3), dtype=torch.float32, device=logits.device)
    cand_v = torch.empty((num_rows, chunks, max(n, 1)), dtype=torch.float32, device=logits.device)
    cand_i = torch.empty((num_rows, chunks, max(n, 1)), dtype=torch.int32, device=logits.device)
    _top_logprobs_chunk_kernel[(num_rows, chunks)](
        logits, logits.stride(0), sampled, part, cand_v, cand_i, vocab_size,
        N=n, BLOCK_N=triton.next_power_of_2(max(n, 1)), CHUNK=_TOP_CHUNK, num_warps=4)
    _top_logprobs_row_kernel[(num_rows,)](
        logits, logits.stride(0), sampled, act, part, cand_v, cand_i, ints, floats, chunks,
        N=n, BLOCK_C=triton.next_power_of_2(chunks), BLOCK_CAND=triton.next_power_of_2(chunks * max(n, 1)),
        num_warps=4)
    return ints, floats
