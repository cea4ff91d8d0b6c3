"""Building blocks shared by the decoder models."""
from __future__ import annotations

import math

import torch
from torch import nn

from headrace.checkpoint.config import RopeConfig
from headrace.kernels import dense, dispatch
from headrace.kernels.norm import prenorm


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


def fuse_few_rows(linear: nn.Linear) -> None:
    """Let project() run linear's few-row calls on a GPU through kernels/dense.py:
    the layer gets that kernel's split-K counters."""
    counts = torch.zeros(dense.split_k_tiles(linear.out_features), dtype=torch.int32, device=linear.weight.device)
    linear.register_buffer("splitk_counts", counts, persistent=False)


def project(
    linear: nn.Module,
    x: torch.Tensor,  # [num_tokens, in_features]
    norm: RMSNorm | None = None,
    residual: torch.Tensor | None = None,  # with norm: x + residual is normalised (None: x alone)
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(linear(norm(x + residual)), then silu_and_mul if gated; the next residual:
    x + residual, x without one, None without norm). A few rows through a float
    layer that fuse_few_rows prepared, on a GPU, take one launch for all of it
    (kernels/dense.py); an FP8 layer that quantizes its input makes it with the
    norm in one launch (Fp8Linear.normed); a 4-bit layer's few-row kernels take SiLU-and-mul
    (Int4Linear.forward_gated); otherwise the steps run one by one."""
    counts = getattr(linear, "splitk_counts", None)
    plain = norm is None and not gated
    if (counts is not None and x.is_cuda and 0 < x.shape[0] <= dense.max_rows(linear.weight.shape[0], plain)
            and x.dtype == linear.weight.dtype and (norm is None or norm.weight.dtype == x.dtype)):
        return dense.dense_linear(x, linear.weight, linear.bias, None if norm is None else (norm.weight, norm.eps),
                                  residual, gated, counts)
    quantizes = getattr(linear, "quantizes", None)  # an FP8 layer, whose input quantization can take the norm in
    if norm is not None and quantizes is not None and quantizes(x) and norm.weight.dtype == x.dtype:
        y, residual = linear.normed(x, norm.weight, norm.eps, residual)
        return (silu_and_mul(y) if gated else y), residual
    if norm is not None:
        x, residual = prenorm(dispatch.rms_norm, x, norm.weight, norm.eps, residual)
    runs_gated = getattr(linear, "runs_gated", None)  # a 4-bit layer, whose few-row kernels take SiLU-and-mul
    if gated and runs_gated is not None and runs_gated(x):
        return linear.forward_gated(x), residual
    y = linear(x)
    return (silu_and_mul(y) if gated else y), residual


def project_gated(gate_up: nn.Module, down: nn.Module, x: torch.Tensor, norm: RMSNorm,
                  residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A gated MLP: (down(silu_and_mul(gate_up(norm(x + residual)))), the next residual). An FP8
    down projection that quantizes these rows takes SiLU-and-mul into its quantization."""
    quantizes = getattr(down, "quantizes", None)
    if quantizes is not None and quantizes(x):
        y, residual = project(gate_up, x, norm, residual)
        return down.gated(y), residual
    act, residual = project(gate_up, x, norm, residual, gated=True)
    return project(down, act)[0], residual


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
    the decoder applies it with Attention.from_qkv (kernels/qkv.py)."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(rope, head_dim))
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
