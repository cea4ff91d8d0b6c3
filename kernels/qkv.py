"""From the fused q|k|v projection to attention's inputs: torch reference and Triton kernel.

The reference is the model's own sequence of steps: split q, k and v into heads; for
Qwen3, RMSNorm each q and k head (kernels/norm.py); rotate q and k (kernels/rotary.py);
write k and v into the paged cache at the tokens' slots (kernels/attention.py's
write_kv_ref). It returns q. The Triton kernel does all of it in one launch, rounding
where those steps round, so the decoder layer has one launch here rather than four.

In a decode step (one query a request) decode_attention goes further: the decode
attention kernel itself rotates q and writes k and v, so the layer has one launch
from q|k|v to attention's output (two with split-K). Its reference is
rope_and_cache_ref followed by paged_attention_ref.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from headrace.kernels.attention import launch_decode, paged_attention_ref, store_token_kv, write_kv_ref
from headrace.kernels.device import pdl_args, wait_for_previous
from headrace.kernels.norm import cast_rtne, rms_norm_ref
from headrace.kernels.rotary import rotary_ref, rotary_table, rotate_heads


def rope_and_cache_ref(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
    positions: torch.Tensor,  # [num_tokens] integer
    cos_sin: torch.Tensor,  # [max_positions, head_dim] float32 (kernels/rotary.py)
    q_weight: torch.Tensor | None,  # [head_dim]: the per-head q RMSNorm's weight (None: no q/k norm)
    k_weight: torch.Tensor | None,  # [head_dim]
    eps: float,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]; k and v written
    slot_mapping: torch.Tensor,  # [num_tokens] token -> flat slot, -1 to skip
    num_heads: int,
) -> torch.Tensor:  # q [num_tokens, num_heads, head_dim], normed and rotated
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(-1, num_heads, head_dim)
    k = k.view(-1, num_kv_heads, head_dim)
    if q_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    q, k = rotary_ref(positions, q, k, cos_sin)
    write_kv_ref(k, v.view(-1, num_kv_heads, head_dim), kv_cache, slot_mapping)
    return q


# Triton: one program per token. Its q heads, then its k heads, go through in
# tiles of [BLOCK_H heads, BLOCK_D] and [BLOCK_KV heads, BLOCK_D], unrolled (the
# head counts are constexprs: on an H100 one tile each, sized to the heads, took
# 76.5 us at 8192 tokens of Qwen3-0.6B's heads where a runtime loop over tiles
# sized to the q heads took 107.7; kernels/rotary.py's rotate_heads: with NORM
# each head is normalised as kernels/norm.py does and rounded to the model dtype
# before the rotation, which rounds again, as rotary_ref does). k, rounded so, and
# v are then stored in the cache as write_kv_ref stores them (attention.py's
# store_token_kv). A token whose slot is -1 (padding) writes no cache.
@triton.jit
def _rope_and_cache_kernel(
    qkv_ptr, stride_t,
    positions_ptr, cos_sin_ptr, cos_sin_stride,
    q_weight_ptr, k_weight_ptr, eps,
    q_ptr,  # [num_tokens, num_heads, head_dim], contiguous
    cache_ptr, stride_c_kv, stride_c_blk, stride_c_slot, stride_c_h,
    slot_mapping_ptr, head_dim,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    NORM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    # the step's inputs, written before its first kernel: read while the kernel before ends
    cos, sin = rotary_table(tl.load(positions_ptr + token).to(tl.int64), cos_sin_ptr, cos_sin_stride, offs_d, head_dim)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    wait_for_previous(PDL)
    d_mask = (offs_d < head_dim)[None, :]
    row = qkv_ptr + token * stride_t
    for h0 in tl.static_range(0, NUM_HEADS, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[:, None]
        mask = (h < NUM_HEADS) & d_mask
        q = rotate_heads(row + h * head_dim, mask, offs_d, head_dim, cos, sin, q_weight_ptr, eps, NORM)
        tl.store(q_ptr + (token * NUM_HEADS + h) * head_dim + offs_d[None, :], cast_rtne(q, q_ptr.dtype.element_ty),
                 mask=mask)
    if slot >= 0:
        cache_row = cache_ptr + (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_slot
        for g0 in tl.static_range(0, NUM_KV_HEADS, BLOCK_KV):
            kh = g0 + tl.arange(0, BLOCK_KV)[:, None]
            k_src = row + (NUM_HEADS + kh) * head_dim
            store_token_kv(k_src, k_src + NUM_KV_HEADS * head_dim, cache_row + kh * stride_c_h, stride_c_kv,
                           (kh < NUM_KV_HEADS) & d_mask, offs_d, head_dim, cos, sin, k_weight_ptr, eps, NORM)


_TILE = 2048  # elements of one tile of whole heads (heads x head_dim)


def _check(qkv, positions, cos_sin, q_weight, k_weight, kv_cache, slot_mapping, num_heads) -> None:
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    assert qkv.dim() == 2 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(1) == 1
    assert head_dim % 2 == 0 and cos_sin.shape[1] == head_dim and cos_sin.dtype == torch.float32
    assert positions.shape == (num_tokens,) and slot_mapping.shape == (num_tokens,)
    assert (q_weight is None) == (k_weight is None) and kv_cache.stride(4) == 1


def rope_and_cache(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], last dim contiguous
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """rope_and_cache_ref in one launch; q is a new contiguous tensor."""
    _check(qkv, positions, cos_sin, q_weight, k_weight, kv_cache, slot_mapping, num_heads)
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    block_d = triton.next_power_of_2(head_dim)
    block_h, block_kv = (min(triton.next_power_of_2(n), max(_TILE // block_d, 1)) for n in (num_heads, num_kv_heads))
    _rope_and_cache_kernel[(num_tokens,)](
        qkv, qkv.stride(0),
        positions, cos_sin, cos_sin.stride(0),
        q_weight if q_weight is not None else cos_sin, k_weight if k_weight is not None else cos_sin, eps,
        q,
        kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        slot_mapping, head_dim, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        NORM=q_weight is not None, BLOCK_SIZE=kv_cache.shape[2], BLOCK_H=block_h, BLOCK_KV=block_kv, BLOCK_D=block_d,
        num_warps=4, **pdl_args(qkv.device),
    )
    return q


def decode_attention_ref(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    query_start_loc: list[int],  # [num_reqs + 1]: one query a request (or none)
    seq_lens: list[int],
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """A decode step's attention from its q|k|v projection: rope_and_cache_ref,
    then paged_attention_ref."""
    q = rope_and_cache_ref(qkv, positions, cos_sin, q_weight, k_weight, eps, kv_cache, slot_mapping, num_heads)
    return paged_attention_ref(q, kv_cache, query_start_loc, seq_lens, block_tables, scale)


def decode_attention(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32 on qkv's device
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_tables: torch.Tensor,
    scale: float,
    max_seq_len: int,  # upper bound on seq_lens
    num_splits: int | None = None,  # split-K partitions; None picks from the shapes
    ids_ahead: bool | None = None,  # the kernel's block-id reads (attention.py's paged_attention)
    order: torch.Tensor | None = None,  # [num_reqs] int32: the order the kernel takes the requests in
) -> torch.Tensor:
    """decode_attention_ref for a step whose every request has at most one
    query, in one launch (two with split-K): the decode attention kernel
    rotates q and writes k and v as it goes (kernels/attention.py). Tokens of
    no request (padding) get no output and write no cache."""
    _check(qkv, positions, cos_sin, q_weight, k_weight, kv_cache, slot_mapping, num_heads)
    out = torch.empty((qkv.shape[0], num_heads, kv_cache.shape[4]), dtype=qkv.dtype, device=qkv.device)
    if qkv.shape[0] and seq_lens.shape[0]:
        launch_decode(qkv, kv_cache.shape[4], out, kv_cache, query_start_loc, seq_lens, block_tables, scale,
                      max_seq_len, num_splits, (positions, cos_sin, q_weight, k_weight, eps, slot_mapping), ids_ahead,
                      order)
    return out
