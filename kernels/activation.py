"""SiLU-and-multiply (the gated MLP activation): torch reference and Triton kernel.

The reference defines what the model's MLP computes (transformers'
act_fn(gate_proj(x)) * up_proj(x)): gate, up = x halves of the last dim;
silu(gate) is rounded to x's dtype, then multiplied by up and rounded again.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from headrace.kernels.device import pdl_args, wait_for_previous
from headrace.kernels.norm import cast_rtne


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * d] -> [num_tokens, d]
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


# Triton: one program per (token, block of d). Arithmetic is float32; the
# result of silu is rounded to x's dtype before the product, the rounding
# point of the torch module (free for float32, and for bf16/fp16 it keeps the
# kernel within the last bit of the model's torch path rather than one
# rounding away from it).
_BLOCK = 1024


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr):
    """float32 gate and up -> silu(gate) * up in dtype, silu(gate) rounded to dtype first (the model's
    rounding points); shared by every kernel that computes the gated activation."""
    act = cast_rtne(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)
    return cast_rtne(act * up, dtype)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, x_stride,
    out_ptr, out_stride,
    d,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + d + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + offs, silu_mul(gate, up, x_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2 * d] -> new [num_tokens, d]
    """Triton version of silu_and_mul_ref. x's rows may be strided (last dim
    contiguous); the output is a new contiguous tensor of x's dtype."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(-1) == 1, (x.shape, x.stride())
    num_tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, d), dtype=x.dtype, device=x.device)
    if num_tokens > 0 and d > 0:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, _BLOCK))](
            x, x.stride(0),
            out, out.stride(0),
            d,
            BLOCK=_BLOCK, num_warps=4, **pdl_args(x.device),
        )
    return out
