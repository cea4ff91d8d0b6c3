"""Neox-style rotary embedding from a float32 cos/sin table: the torch reference.

The reference defines what the model's rotary embedding computes: for each token,
cos, sin = cos_sin[position] split in halves, and each head x = (x1, x2) of
q and k becomes (x1*cos - x2*sin, x2*cos + x1*sin), computed in float32 and
cast back to x's dtype. On a GPU, rotate_heads below does it inside the kernels that
read the fused q|k|v projection (kernels/qkv.py, and decode attention).
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


# Triton: whole heads as one tile. Each lane loads its own element and its
# rotation partner (the element half a head away), so a head's two halves need
# no split and no join, and a kernel can hand the rotated head straight to a
# dot. Used by kernels/qkv.py's cache write and by the decode attention kernel,
# so both round alike.


@triton.jit
def rotary_table(pos, cos_sin_ptr, cos_sin_stride, offs_d, head_dim):
    """The cos and sin [1, BLOCK_D] that rotate_heads multiplies lanes offs_d by at position pos
    (each lane's own frequency: lane i and its partner i +- head_dim / 2 share one)."""
    half = head_dim // 2
    d_mask = offs_d < head_dim
    table = cos_sin_ptr + pos * cos_sin_stride + tl.where(offs_d < half, offs_d, offs_d - half)
    cos = tl.load(table, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(table + half, mask=d_mask, other=0.0)[None, :]
    return cos, sin


@triton.jit
def rotate_heads(src, mask, offs_d, head_dim, cos, sin, w_ptr, eps, NORM: tl.constexpr):
    """src [H, 1]: pointers to heads in the model dtype, mask [H, BLOCK_D] (lanes
    offs_d [BLOCK_D]); cos, sin: rotary_table's at the token's position -> the
    heads rotated, in float32. With NORM each head is first RMS-normalised with
    weight w_ptr [head_dim] and rounded as kernels/norm.py rounds, as the model's
    per-head q/k norm does."""
    half = head_dim // 2
    low = offs_d < half
    partner = tl.where(low, offs_d + half, offs_d - half)  # [BLOCK_D]
    d_mask = offs_d < head_dim
    x = tl.load(src + offs_d[None, :], mask=mask, other=0.0)  # [H, BLOCK_D]
    xp = tl.load(src + partner[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    xf, xpf = x.to(tl.float32), xp.to(tl.float32)
    if NORM:
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / head_dim + eps)[:, None]  # [H, 1]
        w = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(w_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        xf = cast_rtne(w * cast_rtne(xf * rstd, dtype).to(tl.float32), dtype).to(tl.float32)
        xpf = cast_rtne(wp * cast_rtne(xpf * rstd, dtype).to(tl.float32), dtype).to(tl.float32)
    return xf * cos + tl.where(low[None, :], -xpf, xpf) * sin  # (x1 cos - x2 sin, x2 cos + x1 sin)
