"""FP8 (E4M3) linear layers: weights per output channel, activations per token.

fp8_linear runs torch._scaled_mm on a GPU that has FP8 tensor cores
(compute capability 8.9 and up); fp8_linear_ref does the same arithmetic
by dequantizing (the quantized values times their scales, in the input's
dtype), which is what runs on the CPU and what the tests compare against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_MIN_SCALE = 1e-12  # an all-zero row or channel keeps a finite scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] -> (x as FP8, float32 scale [rows, 1]): each row scaled so its largest magnitude is 448."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear_ref(
    x: torch.Tensor,  # [tokens, in_features] bf16/fp16/fp32
    weight: torch.Tensor,  # [out_features, in_features] float8_e4m3fn
    weight_scale: torch.Tensor,  # [out_features, 1] float32
    bias: torch.Tensor | None,  # [out_features] in x's dtype
) -> torch.Tensor:
    x_q, x_scale = quantize_rows(x)
    return F.linear((x_q.float() * x_scale).to(x.dtype), (weight.float() * weight_scale).to(x.dtype), bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    x_q, x_scale = quantize_rows(x)
    # weight.t() is column-major, as _scaled_mm wants its second operand.
    return torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.t(), bias=bias,
                            out_dtype=x.dtype)
