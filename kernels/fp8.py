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

from headrace.kernels.device import num_sms

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


# Triton, for few rows (decode) over long rows, where cuBLAS's FP8 GEMM reads
# the weights below the memory's rate: program (n tile, split) multiplies split's run of K
# for all rows, the E4M3 values widened to bfloat16 (exactly) into a float32
# dot; _fp8_scale_kernel adds the splits in a fixed order (no atomics) and
# applies both scales and the bias, so the arithmetic is _scaled_mm's.
@triton.jit
def _e4m3_bits_to_float(b):
    """E4M3 bytes -> their values in float32, decoded by hand: Triton's
    interpreter converts neither E4M3 nor bfloat16 (the GPU converts natively)."""
    b = b.to(tl.int32)
    e, m = (b >> 3) & 0xF, (b & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))  # 2^-9 m, (8 + m) 2^(e-10)
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(xq_ptr, w_ptr, part_ptr, M, N, K, k_per_split, NATIVE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, split = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    k_start = split * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = tl.load(xq_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0)
        # [BLOCK_N, BLOCK_K] bytes, each row a contiguous run of a weight row
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0)
        if NATIVE:  # the bytes as E4M3, widened exactly to bfloat16
            acc = tl.dot(x.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16),
                         tl.trans(w.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)), acc)
        else:
            acc = tl.dot(_e4m3_bits_to_float(x), tl.trans(_e4m3_bits_to_float(w)), acc, input_precision="ieee")
    tl.store(part_ptr + split * M * N + offs_m[:, None] * N + offs_n[None, :], acc,
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["M"])
def _fp8_scale_kernel(part_ptr, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, num_splits,
                      HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in range(1, num_splits):
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    m, n = offs // N, offs % N
    acc = acc * tl.load(xs_ptr + m, mask=mask, other=0.0) * tl.load(ws_ptr + n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# The Triton kernel takes at most GEMV_MAX_ROWS rows of at least GEMV_MIN_K
# features: on an H100 (benchmarks/fp8_kernel.py) it beat _scaled_mm only
# there, 35 against 44 us for Qwen3-8B's down projection (K = 12288) at 1 to
# 16 rows, and tied or lost on the shorter K of q|k|v, o and gate|up.
GEMV_MAX_ROWS, GEMV_MIN_K = 16, 8192
# (BLOCK_N, BLOCK_K, num_warps, programs per SM the K splits aim for)
GEMV_CONFIG = (128, 256, 4, 2)


def fp8_gemv(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype, config: tuple = GEMV_CONFIG) -> torch.Tensor:
    """(x_q [M, K] E4M3 * x_scale [M, 1]) @ (weight [N, K] E4M3 * weight_scale [N, 1])^T + bias, M <= 16."""
    block_n, block_k, warps, per_sm = config
    m, k = x_q.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    tiles = triton.cdiv(n, block_n)
    slices = triton.cdiv(k, block_k)
    per_split = triton.cdiv(slices, min(slices, triton.cdiv(per_sm * num_sms(x_q.device), tiles)))
    splits = triton.cdiv(slices, per_split)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x_q.device)
    # E4M3 passed as its bytes: the kernel reinterprets them (as the interpreter can too)
    _fp8_gemv_kernel[(tiles, splits)](x_q.view(torch.uint8), weight.view(torch.uint8), part, m, n, k,
                                      per_split * block_k, NATIVE=x_q.is_cuda, BLOCK_M=16,
                                      BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    block = 1024
    _fp8_scale_kernel[(triton.cdiv(m * n, block),)](part, x_scale, weight_scale, bias if bias is not None else part,
                                                   out, m, n, splits, HAS_BIAS=bias is not None, BLOCK=block)
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    x_q, x_scale = quantize_rows_triton(x) if input_scale is None else quantize_static(x, input_scale)
    if 0 < x.shape[0] <= GEMV_MAX_ROWS and x.shape[1] >= GEMV_MIN_K:
        return fp8_gemv(x_q, x_scale, weight, weight_scale, bias, x.dtype)
    # weight.t() is column-major, as _scaled_mm wants its second operand.
    return torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.t(), bias=bias,
                            out_dtype=x.dtype)
