"""Paged attention (torch reference and Triton kernels), and the KV-cache
write's reference (on a GPU kernels/qkv.py writes the cache as it rotates k).

KV cache layout, per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 keys, 1 values). A token at position p of a request lives in block
block_table[p // block_size] at offset p % block_size; its flat slot is
block_id * block_size + offset.
"""
from __future__ import annotations

import torch


def write_kv_ref(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] token -> flat slot, -1 to skip
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
    flat[0, slots] = k[keep].to(kv_cache.dtype)
    flat[1, slots] = v[keep].to(kv_cache.dtype)


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: list[int],  # [num_reqs + 1]
    seq_lens: list[int],  # [num_reqs] tokens in the cache after this step, queries included
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] request -> block ids
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each request's queries (its last tokens) over its cached keys.

    Mixed batches are fine: a decode row has one query, a prefill chunk many.
    Decode rows are computed together, padded to the longest context;
    prefill rows one at a time. Softmax runs in float32.
    """
    out = torch.empty_like(q)
    decode = [i for i in range(len(seq_lens)) if query_start_loc[i + 1] - query_start_loc[i] == 1]
    if decode:
        rows = torch.tensor(decode, device=q.device)
        starts = torch.tensor([query_start_loc[i] for i in decode], device=q.device)
        lens = torch.tensor([seq_lens[i] for i in decode], device=q.device)
        out[starts] = _attend(q[starts, None], kv_cache, block_tables[rows], lens, max(seq_lens[i] for i in decode),
                              scale)[:, 0]
    for i in sorted(set(range(len(seq_lens))) - set(decode)):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        if end > start:
            lens = torch.tensor([seq_lens[i]], device=q.device)
            out[start:end] = _attend(q[None, start:end], kv_cache, block_tables[i : i + 1], lens, seq_lens[i],
                                     scale)[0]
    return out


def _attend(q, kv_cache, block_tables, seq_lens, max_len: int, scale: float) -> torch.Tensor:
    """q [rows, num_q, heads, dim], each row's queries being the last num_q
    positions of its sequence; keys past a row's seq_len are masked."""
    num_heads = q.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    num_blocks = -(-max_len // block_size)
    blocks = block_tables[:, :num_blocks].long()  # [rows, num_blocks]
    k = kv_cache[0, blocks].flatten(1, 2)[:, :max_len]  # [rows, max_len, kv_heads, dim]
    v = kv_cache[1, blocks].flatten(1, 2)[:, :max_len]
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=2)
    v = v.float().repeat_interleave(group, dim=2)
    scores = torch.einsum("rqhd,rkhd->rhqk", q.float(), k) * scale
    num_q = q.shape[1]
    q_pos = seq_lens[:, None] - num_q + torch.arange(num_q, device=q.device)[None, :]  # [rows, num_q]
    k_pos = torch.arange(max_len, device=q.device)
    masked = k_pos[None, None, :] > q_pos[:, :, None]  # causal, and past the row's length
    scores.masked_fill_(masked[:, None], float("-inf"))
    return torch.einsum("rhqk,rkhd->rqhd", scores.softmax(dim=-1), v).to(q.dtype)


def paged_attention_torch(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    num_splits: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """paged_attention_ref called the way paged_attention is: device tensors
    and host bounds in, so a dispatcher can pick either by device. The bounds
    and num_splits only steer the Triton kernels and are ignored here."""
    del max_query_len, max_seq_len, num_splits
    return paged_attention_ref(q, kv_cache, query_start_loc.tolist(), seq_lens.tolist(), block_tables, scale)


# ---------------------------------------------------------------------------
# Triton.
#
# Both attention kernels keep fp32 running (max, sum, acc) statistics in the
# log2 domain (scores are multiplied by scale * log2(e) and exponentiated with
# exp2) and read keys and values one key per lane through the block table, so
# any power-of-two block_size works with any key tile. Query heads that share
# a KV head are packed into the rows of one tile (GQA): a tile row is
# (query token, head within the group), so K and V are read once per group.
# The running max starts at a finite _NEG (not -inf): a row or a split that
# sees no key keeps m = _NEG, l = 0, acc = 0 and never produces exp(-inf + inf).
#
# Dispatch (paged_attention), with no host sync: rows with one query (decode
# rows, or a 1-token chunk) go to the decode kernel, split-K when the contexts
# are long and the batch too small to fill the GPU; rows with more go to the
# general kernel, whose query tile is sized from max_query_len. Both kernels
# get every row and return at once on the other's, so a mixed batch is two
# launches (three with split-K) and an all-decode batch (max_query_len == 1)
# skips the general kernel. Decode rows are cheaper in the decode kernel: in
# the general one they would occupy a whole BLOCK_M-row tile sized for the
# longest chunk (measured on an H200: 64 decode rows of 2k context beside a
# 512-token chunk took 361 us all through the general kernel).


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from headrace.kernels.device import num_sms, pdl_args, wait_for_previous  # noqa: E402
from headrace.kernels.norm import cast_rtne  # noqa: E402
from headrace.kernels.rotary import rotary_table, rotate_heads  # noqa: E402

_LOG2E = 1.4426950408889634
_NEG = tl.constexpr(-1.0e30)  # a constexpr global: readable inside kernels
# Decode split-K (benchmarks/decode_attention.py, Qwen3's 8 KV heads on an H100): the
# fastest counts gave 256 to 512 (request, KV head, split) programs, down to one
# 64-key tile a split; at 1 request and 1024 keys 16 splits took 8.2 us against 3's 15.1.
_MAX_SPLITS = 32
_MIN_KEYS_PER_SPLIT = 64
_PROGRAMS_PER_SM = 3
# Up to this many (request, KV head) pairs the decode kernel reads block ids a tile ahead (_attend_keys's
# IDS_AHEAD): at 8 KV heads, one or two requests. Measured faster there at contexts up to 4096, where the
# picked splits leave each program one or two tiles; longer contexts (more tiles a program) are unmeasured.
_IDS_AHEAD_PAIRS = 16


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """tl.dot with fp32 accumulation. UPCAST_DOT is for the Triton interpreter,
    whose dot multiplies bfloat16 operands' raw bits: the operands are widened
    to float32 first, exactly, so the products match the GPU's bf16 MMA."""
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _tile_slots(block_table_ptr, start, key_hi, stride_c_blk, stride_c_slot, BLOCK_SIZE: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """[BLOCK_N] int64: where keys start .. start + BLOCK_N - 1 sit in the cache (block 0's slots for
    those at or past key_hi, whose block ids are not read)."""
    k_pos = start + tl.arange(0, BLOCK_N)
    blk = tl.load(block_table_ptr + k_pos // BLOCK_SIZE, mask=k_pos < key_hi, other=0).to(tl.int64)
    return blk * stride_c_blk + (k_pos % BLOCK_SIZE).to(tl.int64) * stride_c_slot


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, q_pos,  # as _attend_keys's
    start, key_hi,  # keys start .. start + BLOCK_N - 1, those at or past key_hi masked
    slot_off,  # [BLOCK_N] int64: _tile_slots of this tile
    k_base, v_base, offs_d, d_mask, qk_scale,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    MASKED: tl.constexpr = True,
):
    """One tile of keys added to the running statistics. Without MASKED every key of the tile is below
    key_hi and at or before every row's position: nothing is masked."""
    k_pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    if MASKED:
        k_valid = k_pos < key_hi
        kv_mask = k_valid[:, None] & d_mask[None, :]  # [BLOCK_N, BLOCK_D]
    else:
        kv_mask = d_mask[None, :]  # [1, BLOCK_D]
    k = tl.load(k_base + slot_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    qk = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * qk_scale  # [M, BLOCK_N]
    if MASKED:
        causal = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        qk = tl.where(causal, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    p = tl.exp2(qk - m_new[:, None])  # [M, BLOCK_N]
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + slot_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
    return acc, m_new, l_i


@triton.jit
def _attend_keys(
    acc, m_i, l_i,  # [M, BLOCK_D] fp32, [M] fp32, [M] fp32: running statistics
    q,  # [M, BLOCK_D] in the cache's compute dtype
    q_pos,  # [M] int32: each row's query position; keys after it are masked
    key_lo, key_hi,  # keys [key_lo, key_hi) of the request are visited
    block_table_ptr,  # this request's row of the block table
    first_off,  # with IDS_AHEAD: [BLOCK_N] int64, _tile_slots of the first tile (key_lo), read by the caller
    k_base, v_base,  # cache pointers at this KV head (block 0, slot 0, dim 0)
    stride_c_blk, stride_c_slot,
    offs_d, d_mask,  # [BLOCK_D]
    qk_scale,  # scale * log2(e)
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    IDS_AHEAD: tl.constexpr, MASKED: tl.constexpr = True,
):
    """Each tile reads its block ids, then its keys; with IDS_AHEAD each tile reads the next tile's ids
    before its own keys, so no key load waits on an id load (faster at one or two tiles a program, slower
    over many: benchmarks/RESULTS.md). Without MASKED the keys are whole tiles that every row sees
    (_attend_tile)."""
    if IDS_AHEAD:
        slot_off = first_off
        for start in range(key_lo, key_hi, BLOCK_N):
            next_off = _tile_slots(block_table_ptr, start + BLOCK_N, key_hi, stride_c_blk, stride_c_slot,
                                   BLOCK_SIZE, BLOCK_N)
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, start, key_hi, slot_off, k_base, v_base, offs_d,
                                         d_mask, qk_scale, BLOCK_N, DOT_PRECISION, UPCAST_DOT, MASKED)
            slot_off = next_off
    else:
        for start in range(key_lo, key_hi, BLOCK_N):
            slot_off = _tile_slots(block_table_ptr, start, key_hi, stride_c_blk, stride_c_slot, BLOCK_SIZE, BLOCK_N)
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, start, key_hi, slot_off, k_base, v_base, offs_d,
                                         d_mask, qk_scale, BLOCK_N, DOT_PRECISION, UPCAST_DOT, MASKED)
    return acc, m_i, l_i


@triton.jit
def store_token_kv(
    k_src, v_src,  # [H, 1] pointers to the token's k and v heads in the q|k|v row (model dtype)
    dst,  # [H, 1] pointers to the token's key slot at those heads in the cache; its values are stride_c_kv on
    stride_c_kv, mask, offs_d, head_dim,  # mask [H, BLOCK_D]; lanes offs_d [BLOCK_D]
    cos, sin, k_weight_ptr, eps, NORM: tl.constexpr,  # cos, sin: kernels/rotary.py's rotary_table at the token
):
    """Rotate a token's k heads (normed first with NORM, kernels/rotary.py's
    rotate_heads), round them to the model dtype and then to the cache's, and
    store them and the v heads at the token's slot, as write_kv_ref does."""
    dtype = k_src.dtype.element_ty
    cache_dtype = dst.dtype.element_ty
    k = rotate_heads(k_src, mask, offs_d, head_dim, cos, sin, k_weight_ptr, eps, NORM)
    tl.store(dst + offs_d[None, :], cast_rtne(cast_rtne(k, dtype).to(tl.float32), cache_dtype), mask=mask)
    v = tl.load(v_src + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + stride_c_kv + offs_d[None, :], cast_rtne(v, cache_dtype), mask=mask)


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    """The request that owns flat query block q_block: the last i with
    query_start_loc[i] // BLOCK_Q + i <= q_block (that sequence is strictly
    increasing, and request i's blocks are numbered from it)."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    q_ptr, stride_qt, stride_qh,
    out_ptr, stride_ot, stride_oh,
    cache_ptr, stride_c_kv, stride_c_blk, stride_c_slot, stride_c_h,
    query_start_loc_ptr, seq_lens_ptr,
    block_tables_ptr, stride_bt,
    num_reqs, head_dim, qk_scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, SKIP_SINGLE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (query block, KV head). Query blocks are numbered flat
    over the batch: request i's blocks start at query_start_loc[i] // BLOCK_Q + i,
    so num_tokens // BLOCK_Q + num_reqs programs cover any batch. With
    SKIP_SINGLE, single-query rows are left to _paged_decode_kernel."""
    wait_for_previous(PDL)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD  # query tokens per tile
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, tl.program_id(0), num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    num_q = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block = tl.program_id(0) - (q_start // BLOCK_Q + req)  # block within the request
    if q_block * BLOCK_Q >= num_q:
        return
    if SKIP_SINGLE and num_q == 1:
        return  # the decode kernel's row
    seq_len = tl.load(seq_lens_ptr + req)
    context = seq_len - num_q  # the request's queries are its last num_q positions

    offs_m = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + offs_m // GROUP_PAD  # [BLOCK_M] query index within the request
    g = offs_m % GROUP_PAD
    head = kv_head * GROUP + g
    row_valid = (tok < num_q) & (g < GROUP)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    io_mask = row_valid[:, None] & d_mask[None, :]
    q_off = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0)  # [BLOCK_M, BLOCK_D]

    k_base = cache_ptr + kv_head.to(tl.int64) * stride_c_h
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Keys past the block's last query are above the diagonal for every row: never read. Whole tiles
    # before its first query are seen by every row: visited without masks, then the rest with them.
    key_hi = context + tl.minimum(num_q, (q_block + 1) * BLOCK_Q)
    open_hi = (context + q_block * BLOCK_Q) // BLOCK_N * BLOCK_N
    q = q.to(cache_ptr.dtype.element_ty)
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    acc, m_i, l_i = _attend_keys(
        acc, m_i, l_i, q, context + tok, 0, open_hi, bt_row, 0, k_base, k_base + stride_c_kv,
        stride_c_blk, stride_c_slot, offs_d, d_mask, qk_scale,
        BLOCK_SIZE, BLOCK_N, DOT_PRECISION, UPCAST_DOT, False, False,  # IDS_AHEAD, MASKED
    )
    acc, m_i, l_i = _attend_keys(
        acc, m_i, l_i, q, context + tok, open_hi, key_hi, bt_row, 0, k_base, k_base + stride_c_kv,
        stride_c_blk, stride_c_slot, offs_d, d_mask, qk_scale,
        BLOCK_SIZE, BLOCK_N, DOT_PRECISION, UPCAST_DOT, False,
    )
    out = acc / tl.where(row_valid, l_i, 1.0)[:, None]
    o_off = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_off, cast_rtne(out.to(tl.float32), out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _paged_decode_kernel(
    q_ptr, stride_qt, stride_qh,
    out_ptr, stride_ot, stride_oh,
    part_m_ptr, part_l_ptr, part_acc_ptr,  # [num_reqs, num_heads, num_splits(, BLOCK_D)] fp32
    cache_ptr, stride_c_kv, stride_c_blk, stride_c_slot, stride_c_h,
    query_start_loc_ptr, seq_lens_ptr, order_ptr,
    block_tables_ptr, stride_bt,
    num_heads, head_dim, qk_scale, num_splits,
    positions_ptr, cos_sin_ptr, cos_sin_stride, q_weight_ptr, k_weight_ptr, eps, slot_mapping_ptr, num_kv_heads,
    GROUP: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    ROPE: tl.constexpr, NORM: tl.constexpr, IDS_AHEAD: tl.constexpr, ORDERED: tl.constexpr, PDL: tl.constexpr,
):
    """One program per (request, KV head, split) for single-query rows: the
    group's query heads are the tile's rows (padded to GROUP_M >= 16 for
    tl.dot). Split s visits its own run of whole key tiles; with SPLIT the
    unnormalised (max, sum, acc) go to the partial buffers for
    _paged_decode_reduce_kernel, without it the output is written directly.

    With ROPE, q_ptr is the fused q|k|v projection (stride_qh = head_dim) and
    this launch also does kernels/qkv.py's rope_and_cache for the row's token:
    the q heads are normed (NORM) and rotated as they are loaded, and the
    program whose split holds the token's own key rotates its k head and
    stores it and v into the cache, then attends. A barrier orders that store
    before the program's own loads; no other program reads that key.

    What the step's input preparation wrote (query_start_loc, seq_lens, positions,
    the slot mapping), at least two kernels back, is read before wait_for_previous,
    while the kernel before ends: the row's bounds, its slot and its rotary table,
    and with IDS_AHEAD (few programs) its first tile's block ids (_attend_keys).

    Programs start in grid order, a request's KV heads side by side; with
    ORDERED the requests come in order_ptr's order (longest first, so that the
    last programs to start are short ones and no long one is left running
    alone at the end)."""
    rank = tl.program_id(0) // num_kv_heads
    kv_head = tl.program_id(0) % num_kv_heads
    split = tl.program_id(1)
    if ORDERED:
        req = tl.load(order_ptr + rank)
    else:
        req = rank
    q_start = tl.load(query_start_loc_ptr + req)
    single = tl.load(query_start_loc_ptr + req + 1) - q_start == 1
    seq_len = tl.load(seq_lens_ptr + req)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits)
    key_lo = split * tiles_per_split * BLOCK_N
    key_hi = tl.minimum(key_lo + tiles_per_split * BLOCK_N, seq_len)  # may be empty: m, l, acc stay put
    bt_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    if IDS_AHEAD:
        first_off = _tile_slots(bt_row, key_lo, key_hi, stride_c_blk, stride_c_slot, BLOCK_SIZE, BLOCK_N)
    else:
        first_off = 0  # each tile reads its own
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    if ROPE:
        cos, sin = rotary_table(tl.load(positions_ptr + q_start).to(tl.int64), cos_sin_ptr, cos_sin_stride, offs_d,
                                head_dim)
        slot = tl.load(slot_mapping_ptr + q_start).to(tl.int64)
    wait_for_previous(PDL)
    if not single:
        return  # an empty row, or a prefill row: the general kernel's

    g = tl.arange(0, GROUP_M)
    head = kv_head * GROUP + g
    row_valid = g < GROUP
    io_mask = row_valid[:, None] & d_mask[None, :]
    q_row = q_ptr + q_start.to(tl.int64) * stride_qt
    k_base = cache_ptr + kv_head.to(tl.int64) * stride_c_h
    if ROPE:
        q = cast_rtne(rotate_heads(q_row + head[:, None] * stride_qh, io_mask, offs_d, head_dim, cos, sin,
                                   q_weight_ptr, eps, NORM), q_ptr.dtype.element_ty)
        if (key_lo < seq_len) & (seq_len <= key_hi) & (slot >= 0):  # this split holds the token's key
            k_src = q_row + (num_heads + kv_head) * head_dim + tl.zeros([1, 1], dtype=tl.int32)
            dst = k_base + (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_slot
            store_token_kv(k_src, k_src + num_kv_heads * head_dim, dst + tl.zeros([1, 1], dtype=tl.int64),
                           stride_c_kv, d_mask[None, :], offs_d, head_dim, cos, sin, k_weight_ptr, eps, NORM)
        tl.debug_barrier()
    else:
        q = tl.load(q_row + head[:, None] * stride_qh + offs_d[None, :], mask=io_mask, other=0.0)  # [GROUP_M, BLOCK_D]

    acc = tl.zeros([GROUP_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([GROUP_M], _NEG, dtype=tl.float32)
    l_i = tl.zeros([GROUP_M], dtype=tl.float32)
    q_pos = tl.zeros([GROUP_M], dtype=tl.int32) + (seq_len - 1)
    acc, m_i, l_i = _attend_keys(
        acc, m_i, l_i, q.to(cache_ptr.dtype.element_ty), q_pos, key_lo, key_hi, bt_row, first_off,
        k_base, k_base + stride_c_kv, stride_c_blk, stride_c_slot, offs_d, d_mask, qk_scale,
        BLOCK_SIZE, BLOCK_N, DOT_PRECISION, UPCAST_DOT, IDS_AHEAD,
    )
    if SPLIT:
        part = (req.to(tl.int64) * num_heads + head) * num_splits + split  # [GROUP_M]
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_valid[:, None])
    else:
        out = acc / tl.where(row_valid, l_i, 1.0)[:, None]
        o_off = q_start.to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_off, cast_rtne(out.to(tl.float32), out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _paged_decode_reduce_kernel(
    out_ptr, stride_ot, stride_oh,
    part_m_ptr, part_l_ptr, part_acc_ptr,
    query_start_loc_ptr,
    num_heads, head_dim, num_splits,
    SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (request, query head): rescale each split's partial
    sums to the common max and normalise. Split 0 always holds key 0, so the
    common max is a real score and empty splits weigh exp2(_NEG - max) = 0."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + req)  # written by the step's input preparation: before the wait
    single = tl.load(query_start_loc_ptr + req + 1) - q_start == 1
    wait_for_previous(PDL)
    if not single:
        return
    s = tl.arange(0, SPLITS_PAD)
    s_mask = s < num_splits
    part = (req.to(tl.int64) * num_heads + head) * num_splits + s  # [SPLITS_PAD]
    m = tl.load(part_m_ptr + part, mask=s_mask, other=float("-inf"))
    w = tl.exp2(m - tl.max(m, axis=0))  # [SPLITS_PAD]
    l_sum = tl.sum(w * tl.load(part_l_ptr + part, mask=s_mask, other=0.0), axis=0)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    out = tl.sum(w[:, None] * acc, axis=0) / l_sum  # [BLOCK_D]
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
             cast_rtne(out.to(tl.float32), out_ptr.dtype.element_ty), mask=offs_d < head_dim)


def _decode_num_splits(device: torch.device, num_reqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Split the context only while (request, KV head) programs are too few to give
    every SM _PROGRAMS_PER_SM, and keep at least _MIN_KEYS_PER_SPLIT keys a split."""
    by_occupancy = -(-_PROGRAMS_PER_SM * num_sms(device) // max(1, num_reqs * num_kv_heads))
    by_length = -(-max_seq_len // _MIN_KEYS_PER_SPLIT)
    return max(1, min(_MAX_SPLITS, by_occupancy, by_length))


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32, on q's device
    seq_lens: torch.Tensor,  # [num_reqs] int32, on q's device: tokens in the cache after this step
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32: request -> block ids
    scale: float,
    max_query_len: int,  # upper bound on any request's query count; 1 selects the decode kernel
    max_seq_len: int,  # upper bound on seq_lens, for the decode kernel's split count
    num_splits: int | None = None,  # decode split-K partitions; None picks from the shapes
    use_decode_kernel: bool = True,  # False: every row through the general kernel (tests, benchmarks)
    ids_ahead: bool | None = None,  # the decode kernel's block-id reads (_attend_keys); None picks from the shapes
    order: torch.Tensor | None = None,  # [num_reqs] int32: the decode kernel's request order; None: batch order
    decode_launch: tuple[int, int, int] | None = None,  # the decode kernel's (warps, stages, BLOCK_N); None: picked
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] in q's dtype
    """Triton version of paged_attention_ref, with no host sync: the bounds
    are host ints. Single-query rows go to the split-K decode kernel, the
    others to the general (flash attention) kernel; each kernel skips the
    other's rows on the device, and a max_query_len of 1 launches only the
    decode kernel."""
    num_tokens, _, head_dim = q.shape
    num_reqs = seq_lens.shape[0]
    assert q.stride(2) == 1 and kv_cache.shape[4] == head_dim
    out = torch.empty_like(q)
    if num_tokens == 0 or num_reqs == 0:
        return out

    # Rows with more than one query: the general kernel. Single-query rows go
    # to the decode kernel unless use_decode_kernel is off (its tile is sized
    # for one query, where the general kernel's is sized for max_query_len).
    if max_query_len > 1 or not use_decode_kernel:
        launch_prefill(q, out, kv_cache, query_start_loc, seq_lens, block_tables, scale, max_query_len,
                       skip_single=use_decode_kernel)
    if use_decode_kernel:
        launch_decode(q, q.stride(1), out, kv_cache, query_start_loc, seq_lens, block_tables, scale, max_seq_len,
                      num_splits, ids_ahead=ids_ahead, order=order, config=decode_launch)
    return out


def prefill_config(head_dim: int, group_pad: int, max_query_len: int) -> tuple[int, int, int, int]:
    """The general kernel's (BLOCK_M, BLOCK_N, num_warps, num_stages). BLOCK_M rows of (query token, head
    of the group) hold enough for max_query_len tokens, up to 64: on an H100 with Qwen3-0.6B's 2-head
    groups, 64 rows of 4 warps over 64-key tiles, 2 stages deep, were the fastest of a grid of 24 on every
    prompt mix measured (benchmarks/prefill_attention.py), and 8-16% faster than 128 rows of 8 warps, 3
    stages, there and with Qwen3-8B's 4-head groups."""
    block_m = max(group_pad, min(64, max(16, triton.next_power_of_2(max(1, max_query_len) * group_pad))))
    return block_m, 64 if head_dim <= 128 else 32, 4, 2


def launch_prefill(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]: written at the rows of more than one query
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    skip_single: bool = True,  # leave single-query rows to the decode kernel
    config: tuple[int, int, int, int] | None = None,  # (BLOCK_M, BLOCK_N, warps, stages); None: prefill_config
) -> None:
    """The general (flash attention) kernel over the rows with more than one query, or every row."""
    num_tokens, num_heads, head_dim = q.shape
    num_reqs = seq_lens.shape[0]
    common, cache_args = _launch_args(q, kv_cache, query_start_loc, seq_lens, block_tables, num_heads)
    group_pad = triton.next_power_of_2(common["GROUP"])
    block_m, block_n, warps, stages = config or prefill_config(head_dim, group_pad, max_query_len)
    assert block_m >= group_pad
    grid = (num_tokens // (block_m // group_pad) + num_reqs, kv_cache.shape[3])
    _paged_attention_kernel[grid](
        q, q.stride(0), q.stride(1),
        out, out.stride(0), out.stride(1),
        *cache_args,
        query_start_loc, seq_lens,
        block_tables, block_tables.stride(0),
        num_reqs, head_dim, scale * _LOG2E,
        GROUP_PAD=group_pad, BLOCK_M=block_m, SKIP_SINGLE=skip_single,
        num_warps=warps, num_stages=stages, **{**common, "BLOCK_N": block_n},
    )


def _launch_args(q, kv_cache, query_start_loc, seq_lens, block_tables, num_heads) -> tuple[dict, tuple]:
    """Both kernels' shared constexprs and their cache arguments, after checking the shapes."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_reqs = seq_lens.shape[0]
    assert kv_cache.shape[0] == 2 and num_heads % num_kv_heads == 0 and kv_cache.stride(4) == 1
    assert query_start_loc.shape == (num_reqs + 1,) and block_tables.shape[0] == num_reqs
    assert block_size & (block_size - 1) == 0
    block_d = triton.next_power_of_2(head_dim)
    common = dict(
        GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size, BLOCK_N=64 if block_d <= 128 else 32, BLOCK_D=block_d,
        # fp32 dots stay fp32 (no tf32), so fp32 runs match the reference closely.
        DOT_PRECISION="ieee" if kv_cache.dtype == torch.float32 else "tf32",
        UPCAST_DOT=q.device.type != "cuda",  # off the GPU kernels run in the interpreter
        **pdl_args(q.device),
    )
    return common, (kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3))


def decode_config(head_dim: int) -> tuple[int, int, int]:
    """The decode kernel's (num_warps, num_stages, BLOCK_N): 4 warps, 3 stages, 64-key tiles (32 above
    head_dim 128). On an H100 no other launch of a grid of nine was faster across 8-256 requests of Qwen3-0.6B's
    heads (benchmarks/decode_attention.py --configs)."""
    return 4, 3, 64 if head_dim <= 128 else 32


def launch_decode(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], or with rope the q|k|v projection
    stride_qh: int,  # elements from one q head to the next (head_dim in the q|k|v projection)
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]: written at the single-query rows
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seq_len: int,
    num_splits: int | None = None,
    rope: tuple | None = None,  # (positions, cos_sin, q_weight, k_weight, eps, slot_mapping): kernels/qkv.py's
    ids_ahead: bool | None = None,  # as paged_attention's
    order: torch.Tensor | None = None,  # [num_reqs] int32, a permutation of the rows: the order programs start in
    config: tuple[int, int, int] | None = None,  # (warps, stages, BLOCK_N); None: decode_config
) -> None:
    """The decode kernel (and its reduce, with split-K) over the single-query
    rows. With rope, q is the q|k|v projection and the kernel also does
    rope_and_cache for those rows (kernels/qkv.py's decode_attention)."""
    num_reqs, (_, num_heads, head_dim) = seq_lens.shape[0], out.shape
    num_kv_heads = kv_cache.shape[3]
    assert kv_cache.shape[4] == head_dim
    common, cache_args = _launch_args(q, kv_cache, query_start_loc, seq_lens, block_tables, num_heads)
    block_d = common["BLOCK_D"]
    warps, stages, block_n = config or decode_config(head_dim)
    if num_splits is None:
        num_splits = _decode_num_splits(q.device, num_reqs, num_kv_heads, max_seq_len)
    assert num_splits >= 1
    split = num_splits > 1
    if split:
        shape = (num_reqs, num_heads, num_splits)
        part_m = torch.empty(shape, dtype=torch.float32, device=q.device)
        part_l = torch.empty(shape, dtype=torch.float32, device=q.device)
        part_acc = torch.empty(shape + (block_d,), dtype=torch.float32, device=q.device)
    else:  # the kernel writes no partials: out stands in for their pointers
        part_m = part_l = part_acc = out
    if rope is None:  # unused pointers: q stands in
        positions, cos_sin, q_weight, k_weight, eps, slot_mapping = q, q, q, q, 0.0, q
        cos_sin_stride = 0
    else:
        positions, cos_sin, q_weight, k_weight, eps, slot_mapping = rope
        cos_sin_stride = cos_sin.stride(0)
    if order is not None:
        assert order.shape == (num_reqs,) and order.dtype == torch.int32
    _paged_decode_kernel[(num_reqs * num_kv_heads, num_splits)](
        q, q.stride(0), stride_qh,
        out, out.stride(0), out.stride(1),
        part_m, part_l, part_acc,
        *cache_args,
        query_start_loc, seq_lens, seq_lens if order is None else order,
        block_tables, block_tables.stride(0),
        num_heads, head_dim, scale * _LOG2E, num_splits,
        positions, cos_sin, cos_sin_stride, q_weight if q_weight is not None else q,
        k_weight if k_weight is not None else q, eps, slot_mapping, num_kv_heads,
        GROUP_M=max(16, triton.next_power_of_2(common["GROUP"])), SPLIT=split, ROPE=rope is not None,
        NORM=rope is not None and q_weight is not None,
        IDS_AHEAD=num_reqs * num_kv_heads <= _IDS_AHEAD_PAIRS if ids_ahead is None else ids_ahead,
        ORDERED=order is not None, num_warps=warps, num_stages=stages, **{**common, "BLOCK_N": block_n},
    )
    if split:
        _paged_decode_reduce_kernel[(num_reqs, num_heads)](
            out, out.stride(0), out.stride(1),
            part_m, part_l, part_acc,
            query_start_loc,
            num_heads, head_dim, num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits), BLOCK_D=block_d, **pdl_args(q.device),
        )
