"""Counter-based random numbers for sampling: torch reference.

A request's noise at a position is a pure function of (seed, position,
token id), so its samples do not depend on which other requests share the
batch, on batch order, or on preemption and recompute. The hash is a
few rounds of a 32-bit integer mixer computed in int64 with every product
kept below 2**63, so it is exact on any backend.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27, so (x < 2**32) * _MUL < 2**59


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = ((x >> 16) ^ x) * _MUL & _M32
    x = ((x >> 16) ^ x) * _MUL & _M32
    return (x >> 16) ^ x


def uniform_ref(
    seeds: torch.Tensor,  # [num_rows] int64
    positions: torch.Tensor,  # [num_rows] int64, the position of the token being sampled
    vocab_size: int,
) -> torch.Tensor:  # [num_rows, vocab_size] float64 in (0, 1)
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    key = _mix32(lo ^ _mix32(hi ^ 0x9E3779B9))
    key = _mix32(key ^ (positions & _M32))  # [num_rows]
    tokens = _mix32(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) ^ 0x632BE5AB)
    bits = _mix32(key[:, None] ^ tokens[None, :])
    return (bits.double() + 0.5) / 2.0**32


def gumbel_ref(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [num_rows, vocab_size] float32: argmax(logits + noise) samples softmax(logits)."""
    return -torch.log(-torch.log(uniform_ref(seeds, positions, vocab_size))).float()


def gumbel_sample_ref(
    logits: torch.Tensor,  # [num_rows, vocab] float32: temperature-scaled, filtered (-inf = banned)
    seeds: torch.Tensor,  # [num_rows] int64
    positions: torch.Tensor,  # [num_rows] int64
) -> torch.Tensor:  # [num_rows] int64
    """Gumbel-max: argmax(logits + Gumbel noise) is a sample of softmax(logits)."""
    return (logits + gumbel_ref(seeds, positions, logits.shape[-1])).argmax(dim=-1)
