"""Neox-style rotary embedding from a float32 cos/sin table: torch reference and Triton kernel.

The reference defines what the model's rotary embedding computes: for each token,
cos, sin = cos_sin[position] split in halves, and each head x = (x1, x2) of
q and k becomes (x1*cos - x2*sin, x2*cos + x1*sin), computed in float32 and
cast back to x's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from headrace.kernels.norm import cast_rtne


def rotary_ref(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin: torch.Tensor,  # [max_positions, head_dim] float32: cos of the head_dim/2 frequencies, then sin
) -> tuple[torch.Tensor, torch.Tensor]:
    """New rotated (q, k); the inputs are not changed."""
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # [num_tokens, head_dim // 2] each
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


# Triton: one program per token. The token's cos and sin are loaded once and
# applied to all its q heads, then all its k heads, in tiles of
# [BLOCK_H heads, BLOCK_HALF]; each element is read and written once.


@triton.jit
def _rotate_heads(
    ptr, token_stride, head_stride, num_heads, token,
    cos, sin,  # [1, BLOCK_HALF] float32
    half,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    base = ptr + token * token_stride
    for h0 in range(0, num_heads, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)[:, None]
        mask = (offs_h < num_heads) & (offs_d < half)
        p1 = base + offs_h * head_stride + offs_d
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p1 + half, mask=mask, other=0.0).to(tl.float32)
        tl.store(p1, cast_rtne(x1 * cos - x2 * sin, ptr.dtype.element_ty), mask=mask)
        tl.store(p1 + half, cast_rtne(x2 * cos + x1 * sin, ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr, q_stride0, q_stride1, num_heads,
    k_ptr, k_stride0, k_stride1, num_kv_heads,
    cos_sin_ptr, cos_sin_stride,
    half,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)[None, :]
    cs_mask = offs_d < half
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + offs_d, mask=cs_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + half + offs_d, mask=cs_mask, other=0.0)
    _rotate_heads(q_ptr, q_stride0, q_stride1, num_heads, token, cos, sin, half, BLOCK_H, BLOCK_HALF)
    _rotate_heads(k_ptr, k_stride0, k_stride1, num_kv_heads, token, cos, sin, half, BLOCK_H, BLOCK_HALF)


# Elements per tile (heads x half head_dim), two such tiles (x1, x2) live at once.
_TILE = 2048


def rotary(
    positions: torch.Tensor,  # [num_tokens] integer
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], last dim contiguous; rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], last dim contiguous; rotated in place
    cos_sin: torch.Tensor,  # [max_positions, head_dim] float32, last dim contiguous
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of rotary_ref. Rotates q and k in place (they may be
    strided views, e.g. slices of one fused qkv tensor) and returns them."""
    num_tokens, num_heads, head_dim = q.shape
    assert k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim, (q.shape, k.shape)
    assert head_dim % 2 == 0 and cos_sin.dim() == 2 and cos_sin.shape[1] == head_dim
    assert cos_sin.dtype == torch.float32 and q.dtype == k.dtype
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin.stride(-1) == 1
    assert positions.shape == (num_tokens,)
    if num_tokens == 0 or head_dim == 0:
        return q, k
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(num_heads, k.shape[1], 1)), max(_TILE // block_half, 1))
    _rotary_kernel[(num_tokens,)](
        positions,
        q, q.stride(0), q.stride(1), num_heads,
        k, k.stride(0), k.stride(1), k.shape[1],
        cos_sin, cos_sin.stride(0),
        half,
        BLOCK_H=block_h, BLOCK_HALF=block_half,
        num_warps=4,
    )
    return q, k
