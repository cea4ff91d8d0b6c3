"""Neox-style rotary embedding from a float32 cos/sin table: the torch reference.

The reference defines what the model's rotary embedding computes: for each token,
cos, sin = cos_sin[position] split in halves, and each head x = (x1, x2) of
q and k becomes (x1*cos - x2*sin, x2*cos + x1*sin), computed in float32 and
cast back to x's dtype. On a GPU kernels/qkv.py rotates as it splits the
fused q|k|v projection.
"""
from __future__ import annotations

import torch


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
