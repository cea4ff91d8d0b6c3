"""RMSNorm with an optional fused residual add: torch reference and Triton kernel.

The reference defines what the model's RMSNorm computes (transformers'
LlamaRMSNorm): with a residual, s = x + residual in x's dtype (as torch adds);
then s is normalised in float32, cast back to s's dtype, and only then
multiplied by weight, so the result rounds exactly where the model's does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from headrace.kernels.device import pdl_args, wait_for_previous


def rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, hidden] or [num_tokens, num_heads, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # shape of x, dtype of x
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * rmsnorm(x), or with residual (weight * rmsnorm(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, x)


def prenorm(norm_fn, x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm layer's input and the residual past it through norm_fn
    (rms_norm_ref or rms_norm): (norm(x + residual), x + residual), or
    (norm(x), x) without a residual."""
    if residual is None:
        return norm_fn(x, weight, eps), x
    return norm_fn(x, weight, eps, residual)


@triton.jit
def cast_rtne(x, dtype: tl.constexpr):
    """float32 x.to(dtype), rounded to nearest even on the GPU and under the
    Triton interpreter alike. The interpreter truncates float32 -> bfloat16
    (its "rtne" mode mishandles a carry into the exponent, and subnormals
    come out wrong either way), so bfloat16 is rounded here on the bits and
    the top half bitcast; on the GPU that is what cvt.rn.bf16.f32 does, for a
    few integer ops in kernels bound by memory. A NaN becomes the quiet NaN."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bits = tl.where(x != x, 0x7FC0, bits)
        out = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = x.to(dtype)
    return out


@triton.jit
def add_and_normalize(x, res_ptrs, w_ptrs, mask, hidden, eps, HAS_RESIDUAL: tl.constexpr):
    """A whole row x (masked lanes 0) -> weight * rmsnorm(x + residual) in float32, before its last cast;
    with HAS_RESIDUAL, x + residual (at res_ptrs) is written back there. Rounded as rms_norm_ref rounds:
    torch adds two bf16/fp16 tensors in float32 and rounds once, and the cast to x's dtype before the
    weight is the model's rounding point. Shared by the norm kernel and the kernels that fold it in."""
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(res_ptrs, mask=mask, other=0.0)
        x = cast_rtne(x.to(tl.float32) + r.to(tl.float32), dtype)
        tl.store(res_ptrs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    y = cast_rtne(xf * rstd, dtype).to(tl.float32)
    return tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32) * y


# Triton: one program per row; the whole row is one block held in registers,
# so the sum of squares and the normalisation are one pass over memory.
# A row r of a 3-D input [n, m, hidden] (Qwen3's per-head q/k norm over a
# strided view of the qkv projection) lives at (r // m) * stride0 + (r % m) * stride1;
# a 2-D input is the case m = 1.
_MAX_HIDDEN = 16384


@triton.jit
def _rms_norm_kernel(
    x_ptr, x_stride0, x_stride1,
    res_ptr, res_stride0, res_stride1,  # read, then overwritten with x + residual (HAS_RESIDUAL only)
    w_ptr,
    out_ptr,  # contiguous [num_rows, hidden]
    num_inner, hidden, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    outer = row // num_inner
    inner = row % num_inner
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden

    x = tl.load(x_ptr + outer * x_stride0 + inner * x_stride1 + offs, mask=mask, other=0.0)
    y = add_and_normalize(x, res_ptr + outer * res_stride0 + inner * res_stride1 + offs, w_ptr + offs, mask, hidden,
                          eps, HAS_RESIDUAL)
    tl.store(out_ptr + row * hidden + offs, cast_rtne(y, out_ptr.dtype.element_ty), mask=mask)


def _row_strides(t: torch.Tensor) -> tuple[int, int]:
    return (t.stride(0), t.stride(1)) if t.dim() == 3 else (t.stride(0), 0)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden] or [num_tokens, num_heads, hidden], last dim contiguous
    weight: torch.Tensor,  # [hidden], contiguous
    eps: float,
    residual: torch.Tensor | None = None,  # shape and dtype of x, last dim contiguous; overwritten
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton version of rms_norm_ref, with the residual add fused.

    With a residual, x + residual is written in place into residual's buffer
    and residual itself is returned as the second value (the caller's
    residual tensor is consumed, as in vLLM's fused_add_rms_norm). x is never
    written; the normalised output is a new contiguous tensor of x's shape and
    dtype promote_types(weight.dtype, x.dtype).
    """
    assert x.dim() in (2, 3) and x.stride(-1) == 1, (x.shape, x.stride())
    hidden = x.shape[-1]
    assert weight.shape == (hidden,) and weight.stride(0) == 1
    assert hidden <= _MAX_HIDDEN, hidden
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    num_inner = x.shape[1] if x.dim() == 3 else 1
    num_rows = x.shape[0] * num_inner
    if num_rows > 0 and hidden > 0:
        block = triton.next_power_of_2(hidden)
        res = residual if residual is not None else x  # unused pointer when there is no residual
        _rms_norm_kernel[(num_rows,)](
            x, *_row_strides(x),
            res, *_row_strides(res),
            weight,
            out,
            num_inner, hidden, eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block, num_warps=min(max(block // 256, 1), 16), **pdl_args(x.device),
        )
    return out if residual is None else (out, residual)
