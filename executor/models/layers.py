"""Building blocks shared by the decoder models."""
from __future__ import annotations

import math

import torch
from torch import nn

from headrace.checkpoint.config import RopeConfig
from headrace.kernels import dispatch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalise x, or with residual, normalise x + residual and also
        return that sum as the next residual (on a GPU, written into
        residual's buffer)."""
        return dispatch.rms_norm(x, self.weight, self.eps, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * d] -> [num_tokens, d]
    return dispatch.silu_and_mul(x)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:  # [head_dim // 2] float32
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.type == "linear":
        return inv_freq / rope.factor
    if rope.type == "llama3":
        # Long wavelengths are divided by factor, short ones kept, and the
        # band between is interpolated smoothly (Llama 3.1's scheme).
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(rope: RopeConfig, head_dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos then sin of each frequency at each
    position, the table the neox-style rotary embedding (rotate halves) reads;
    the decoder applies it with dispatch.rope_and_cache (kernels/qkv.py)."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(rope, head_dim))
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
