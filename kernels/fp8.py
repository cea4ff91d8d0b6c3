"""FP8 (E4M3) linear layers: weights per output channel, activations per token.

fp8_linear runs torch._scaled_mm on a GPU that has FP8 tensor cores
(compute capability 8.9 and up); fp8_linear_ref does the same arithmetic
by dequantizing (the quantized values times their scales, in the input's
dtype), which is what runs on the CPU and what the tests compare against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_MIN_SCALE = 1e-12  # an all-zero row or channel keeps a finite scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] -> (x as FP8, float32 scale [rows, 1]): each row scaled so its largest magnitude is 448."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


# Triton: one program per row; a first pass finds the row's largest
# magnitude, a second scales (an IEEE division, as torch's) and rounds.
@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, cols, stride_x, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)
    tl.store(scale_ptr + row, scale)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0)
        tl.store(q_ptr + row * stride_q + offs, q.to(tl.float8e4nv), mask=mask)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows for a [rows, cols] tensor whose rows are contiguous, in one launch."""
    assert x.dim() == 2 and x.stride(1) == 1
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=FP8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, q, scale, cols, x.stride(0), q.stride(0),
                                       BLOCK=min(4096, triton.next_power_of_2(cols)))
    return q, scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] -> (x / scale as FP8, the scale repeated [rows, 1]): one fixed scale for every row."""
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.float().reshape(1, 1).expand(x.shape[0], 1).contiguous()


def fp8_linear_ref(
    x: torch.Tensor,  # [tokens, in_features] bf16/fp16/fp32
    weight: torch.Tensor,  # [out_features, in_features] float8_e4m3fn
    weight_scale: torch.Tensor,  # [out_features, 1] float32
    bias: torch.Tensor | None,  # [out_features] in x's dtype
    input_scale: torch.Tensor | None = None,  # [] float32: static activation scale; None: per token
) -> torch.Tensor:
    x_q, x_scale = quantize_rows(x) if input_scale is None else quantize_static(x, input_scale)
    return F.linear((x_q.float() * x_scale).to(x.dtype), (weight.float() * weight_scale).to(x.dtype), bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    x_q, x_scale = quantize_rows_triton(x) if input_scale is None else quantize_static(x, input_scale)
    # weight.t() is column-major, as _scaled_mm wants its second operand.
    return torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.t(), bias=bias,
                            out_dtype=x.dtype)
