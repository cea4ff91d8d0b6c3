"""From the fused q|k|v projection to attention's inputs: torch reference and Triton kernel.

The reference is the model's own sequence of steps: split q, k and v into heads; for
Qwen3, RMSNorm each q and k head (kernels/norm.py); rotate q and k (kernels/rotary.py);
write k and v into the paged cache at the tokens' slots (kernels/attention.py's
write_kv_ref). It returns q. The Triton kernel does all of it in one launch, rounding
where those steps round, so the decoder layer has one launch here rather than four.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from headrace.kernels.attention import write_kv_ref
from headrace.kernels.device import pdl_args, wait_for_previous
from headrace.kernels.norm import cast_rtne, rms_norm_ref
from headrace.kernels.rotary import rotary_ref


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


# Triton: one program per token. Its cos and sin are loaded once; its q heads, then its
# k heads, go through in tiles of [BLOCK_H heads, BLOCK_HALF] for each half of the head
# (the two halves are what the rotation pairs). With NORM each head is normalised as
# kernels/norm.py does (its sum of squares is the two halves' sums added) and rounded
# to the model dtype before the rotation, which rounds again, as rotary_ref does.
# k, rounded so, and v are then stored in the cache as write_kv_ref stores them. A token
# whose slot is -1 (padding) writes no cache.
@triton.jit
def _norm_rotate(x1, x2, w_ptr, cos, sin, eps, head_dim, half, offs_d, d_mask, NORM: tl.constexpr):
    """x1, x2 [BLOCK_H, BLOCK_HALF]: heads' halves in the model dtype -> their rotation in float32."""
    if NORM:
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        var = (tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)) / head_dim  # [BLOCK_H]
        rstd = tl.rsqrt(var + eps)[:, None]
        w1 = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        x1 = cast_rtne(w1 * cast_rtne(x1f * rstd, x1.dtype).to(tl.float32), x1.dtype)
        x2 = cast_rtne(w2 * cast_rtne(x2f * rstd, x2.dtype).to(tl.float32), x2.dtype)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    return x1f * cos - x2f * sin, x2f * cos + x1f * sin


@triton.jit
def _rope_and_cache_kernel(
    qkv_ptr, stride_t,
    positions_ptr, cos_sin_ptr, cos_sin_stride,
    q_weight_ptr, k_weight_ptr, eps,
    q_ptr,  # [num_tokens, num_heads, head_dim], contiguous
    cache_ptr, stride_c_kv, stride_c_blk, stride_c_slot, stride_c_h,
    slot_mapping_ptr,
    num_heads, num_kv_heads, head_dim,
    NORM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    half = head_dim // 2
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    d_mask = offs_d < half
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + offs_d, mask=d_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + half + offs_d, mask=d_mask, other=0.0)
    row = qkv_ptr + token * stride_t
    dtype = qkv_ptr.dtype.element_ty
    for h0 in range(0, num_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)[:, None]
        mask = (h < num_heads) & d_mask
        src = row + h * head_dim + offs_d
        r1, r2 = _norm_rotate(tl.load(src, mask=mask, other=0.0), tl.load(src + half, mask=mask, other=0.0),
                              q_weight_ptr, cos, sin, eps, head_dim, half, offs_d, d_mask, NORM)
        dst = q_ptr + (token * num_heads + h) * head_dim + offs_d
        tl.store(dst, cast_rtne(r1, dtype), mask=mask)
        tl.store(dst + half, cast_rtne(r2, dtype), mask=mask)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # (names apart from the q loop's: none is carried across the two)
        cache_row = cache_ptr + (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_slot
        cache_dtype = cache_ptr.dtype.element_ty
        for g0 in range(0, num_kv_heads, BLOCK_H):
            kh = g0 + tl.arange(0, BLOCK_H)[:, None]
            k_mask = (kh < num_kv_heads) & d_mask
            k_src = row + (num_heads + kh) * head_dim + offs_d
            k1, k2 = _norm_rotate(tl.load(k_src, mask=k_mask, other=0.0),
                                  tl.load(k_src + half, mask=k_mask, other=0.0),
                                  k_weight_ptr, cos, sin, eps, head_dim, half, offs_d, d_mask, NORM)
            k_dst = cache_row + kh * stride_c_h + offs_d
            tl.store(k_dst, cast_rtne(cast_rtne(k1, dtype).to(tl.float32), cache_dtype), mask=k_mask)
            tl.store(k_dst + half, cast_rtne(cast_rtne(k2, dtype).to(tl.float32), cache_dtype), mask=k_mask)
            v_src = k_src + num_kv_heads * head_dim
            v1 = tl.load(v_src, mask=k_mask, other=0.0).to(tl.float32)
            v2 = tl.load(v_src + half, mask=k_mask, other=0.0).to(tl.float32)
            tl.store(k_dst + stride_c_kv, cast_rtne(v1, cache_dtype), mask=k_mask)
            tl.store(k_dst + stride_c_kv + half, cast_rtne(v2, cache_dtype), mask=k_mask)


_TILE = 2048  # elements of one half-head tile (heads x half head_dim)


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
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    assert qkv.dim() == 2 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(1) == 1
    assert head_dim % 2 == 0 and cos_sin.shape[1] == head_dim and cos_sin.dtype == torch.float32
    assert positions.shape == (num_tokens,) and slot_mapping.shape == (num_tokens,)
    assert (q_weight is None) == (k_weight is None) and kv_cache.stride(4) == 1
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    block_half = triton.next_power_of_2(head_dim // 2)
    block_h = min(triton.next_power_of_2(max(num_heads, num_kv_heads)), max(_TILE // block_half, 1))
    _rope_and_cache_kernel[(num_tokens,)](
        qkv, qkv.stride(0),
        positions, cos_sin, cos_sin.stride(0),
        q_weight if q_weight is not None else cos_sin, k_weight if k_weight is not None else cos_sin, eps,
        q,
        kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        slot_mapping,
        num_heads, num_kv_heads, head_dim,
        NORM=q_weight is not None, BLOCK_SIZE=kv_cache.shape[2], BLOCK_H=block_h, BLOCK_HALF=block_half,
        num_warps=4, **pdl_args(qkv.device),
    )
    return q
