"""FP8 (E4M3) linear layers: weights per output channel, activations per token.

fp8_linear runs on a GPU that has FP8 tensor cores (compute capability 8.9
and up): a few rows (decode) through a Triton kernel that widens the weights
and leaves the activations unquantized, more rows quantized per token for a
Triton E4M3 GEMM that splits K (fp8_mm, up to MM_ROWS rows) or, beyond,
torch._scaled_mm; both add in the tensor cores' fast accumulation.
fp8_linear_ref does their arithmetic by dequantizing (the quantized values
times their scales, in the input's dtype), which is what runs on the CPU and
what the tests compare against; fp8_few_rows_ref is the few-rows kernel's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from headrace.kernels import splitk
from headrace.kernels.activation import silu_mul
from headrace.kernels.device import num_sms, pdl_args, prefetch_l2, wait_for_previous
from headrace.kernels.norm import add_and_normalize, cast_rtne
from headrace.kernels.splitk import sum_splits

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_MIN_SCALE = 1e-12  # an all-zero row or channel keeps a finite scale
_FP8_MAX_C, _MIN_SCALE_C = tl.constexpr(FP8_MAX), tl.constexpr(_MIN_SCALE)  # the same, for the kernels


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] -> (x as FP8, float32 scale [rows, 1]): each row scaled so its largest magnitude is 448."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@triton.jit
def _to_e4m3(v, NATIVE: tl.constexpr):
    """float32 v, |v| <= 448 -> E4M3, rounded to nearest even. NATIVE: the GPU's conversion; else in integer
    arithmetic, for Triton's interpreter, whose conversion rounds some values wrongly (-1.9547 to -1.0)."""
    if NATIVE:
        return v.to(tl.float8e4nv)
    bits = v.to(tl.int32, bitcast=True)
    a = bits & 0x7FFFFFFF
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)  # exponent and 3 mantissa bits, rounded
    subnormal = ((tl.abs(v) * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)  # steps of 2^-9, rounded by the add
    byte = tl.where(a < 0x3C800000, subnormal, normal) | ((bits >> 24) & 0x80)  # below 2^-6: subnormal
    return byte.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _scaled_e4m3(x, scale, NATIVE: tl.constexpr):
    """float32 x / scale (an IEEE division, as torch's), clamped to +-448, in E4M3."""
    return _to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -_FP8_MAX_C, _FP8_MAX_C), NATIVE)


@triton.jit
def _quantize_row(y, q_ptr, scale_ptr, row, offs, mask, NATIVE: tl.constexpr):
    """A whole row y (float32, masked lanes 0) -> its scale at scale_ptr + row and its E4M3 values at
    q_ptr + offs, as quantize_rows makes them (an IEEE division, as torch's)."""
    scale = tl.maximum(tl.max(tl.abs(y), axis=0) / _FP8_MAX_C, _MIN_SCALE_C)
    tl.store(scale_ptr + row, scale)
    tl.store(q_ptr + offs, _scaled_e4m3(y, scale, NATIVE), mask=mask)


# Triton: one program per row; a first pass finds the row's largest
# magnitude, a second scales (an IEEE division, as torch's) and rounds. A row of
# at most ONE_PASS columns is loaded once and kept in registers for both.
@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, cols, stride_x, stride_q, BLOCK: tl.constexpr,
                          WHOLE: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    if WHOLE:  # the row in one block (BLOCK >= cols)
        offs = tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        _quantize_row(x, q_ptr, scale_ptr, row, row * stride_q + offs, mask, NATIVE)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + offs, mask=offs < cols, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0) / _FP8_MAX_C, _MIN_SCALE_C)
        tl.store(scale_ptr + row, scale)
        for start in range(0, cols, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < cols
            x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_ptr + row * stride_q + offs, _scaled_e4m3(x, scale, NATIVE), mask=mask)


ONE_PASS = 16384  # columns a program holds at once (16 float32 a thread at 32 warps)


def _row_warps(block: int) -> int:
    """Warps of a one-program-per-row kernel over `block` columns: 8 columns a thread, 4 to 32 warps. At
    decode sizes the rows are fewer than the SMs, so each row's latency is the launch's: on an H100, at 16 to
    128 rows, 4096-column RMSNorm + quantization took 2.6-2.9 us at 16 warps against 3.4-3.8 at 4, and
    12288-column SiLU-and-mul + quantization 6.7-7.0 at 32 warps against 9.2-9.8 at 8 (benchmarks/RESULTS.md)."""
    return min(32, max(4, block // 256))


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows for a [rows, cols] tensor whose rows are contiguous, in one launch."""
    assert x.dim() == 2 and x.stride(1) == 1
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=FP8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        whole = cols <= ONE_PASS
        block = triton.next_power_of_2(cols) if whole else 4096
        _quantize_rows_kernel[(rows,)](x, q, scale, cols, x.stride(0), q.stride(0), BLOCK=block, WHOLE=whole,
                                       NATIVE=x.is_cuda, num_warps=_row_warps(block), **pdl_args(x.device))
    return q, scale


# Triton: a projection's input made and quantized in one launch, one program per
# row held whole in registers: RMSNorm(x + residual) (NORM; the sum written into
# residual, as kernels/norm.py's kernel does) or silu(gate) * up from gate | up
# (GATED), each rounded to x's dtype as its own kernel rounds, then quantized as
# quantize_rows does.
@triton.jit
def _make_and_quantize_kernel(x_ptr, stride_x, res_ptr, w_ptr, eps, q_ptr, scale_ptr, cols, NORM: tl.constexpr,
                              HAS_RES: tl.constexpr, BLOCK: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < cols
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if NORM:
        y = cast_rtne(add_and_normalize(x, res_ptr + row * cols + offs, w_ptr + offs, mask, cols, eps, HAS_RES),
                      dtype).to(tl.float32)
    else:  # gated: x is gate, up follows it
        up = tl.load(x_ptr + row * stride_x + cols + offs, mask=mask, other=0.0).to(tl.float32)
        y = silu_mul(x.to(tl.float32), up, dtype).to(tl.float32)
    _quantize_row(y, q_ptr, scale_ptr, row, row * cols + offs, mask, NATIVE)


def _make_and_quantize(x: torch.Tensor, cols: int, norm: tuple[torch.Tensor, float] | None,
                       residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.shape[0]
    if cols > ONE_PASS or x.stride(-1) != 1:
        raise ValueError(f"a fused quantization takes rows of up to {ONE_PASS} contiguous columns, got {cols}")
    q = torch.empty((rows, cols), dtype=FP8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(cols)
        _make_and_quantize_kernel[(rows,)](
            x, x.stride(0), residual if residual is not None else x, norm[0] if norm else x, norm[1] if norm else 0.0,
            q, scale, cols, NORM=norm is not None, HAS_RES=residual is not None, BLOCK=block, NATIVE=x.is_cuda,
            num_warps=_row_warps(block), **pdl_args(x.device))
    return q, scale


def rms_norm_quantize(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_rows(rms_norm(x + residual)) in one launch -> (E4M3 [rows, cols], float32 scale [rows, 1], the next
    residual: x + residual written into residual's buffer, or x without one). x [rows, cols], cols <= 16384."""
    if residual is not None:
        assert residual.shape == x.shape and residual.is_contiguous() and residual.dtype == x.dtype
    q, scale = _make_and_quantize(x, x.shape[1], (weight, eps), residual)
    return q, scale, x if residual is None else residual


def silu_and_mul_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(silu_and_mul(x)) in one launch: x [rows, 2 d] gate | up, d <= 16384."""
    return _make_and_quantize(x, x.shape[1] // 2, None, None)


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


def fp8_few_rows_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """x @ (weight * weight_scale)^T + bias in float32, in x's dtype: fp8_few_rows's arithmetic."""
    y = x.float() @ (weight.float() * weight_scale).t()
    return (y if bias is None else y + bias.float()).to(x.dtype)


def fp8_mm_ref(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """x_q @ weight^T times both scales, + bias, in float64: fp8_mm's arithmetic without its rounding."""
    y = (x_q.double() @ weight.double().t()) * x_scale.double() * weight_scale.double().t()
    return y if bias is None else y + bias.double()


# Triton, for few rows (decode), where cuBLAS's FP8 GEMM reads the weights well
# below the memory's rate (benchmarks/fp8_kernel.py): the weights are read once
# and widened, the activations are not quantized (so these rows are more exact
# than _scaled_mm's, and there is one launch, not two). One row: FMAs in
# float32, summed along K at each step. Up to FEW_ROWS rows: tl.dot on the
# weights widened (exactly) to the activation dtype, the rows padded to 16 or 32.
# Program (n tile, split) takes split's run of K; kernels/splitk.py adds the splits.
@triton.jit
def _e4m3_bits_to_float(b):
    """E4M3 bytes -> their values in float32, decoded by hand: Triton's
    interpreter converts neither E4M3 nor bfloat16 (the GPU converts natively)."""
    b = b.to(tl.int32)
    e, m = (b >> 3) & 0xF, (b & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * tl.exp2((e - 10).to(tl.float32)))  # 2^-9 m, (8 + m) 2^(e-10)
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit(do_not_specialize=["M"])
def _fp8_few_rows_kernel(x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split,
                         stride_xm, DOT: tl.constexpr, NATIVE: tl.constexpr, HAS_BIAS: tl.constexpr,
                         SPLIT: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    pid_n, split = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    k_start = split * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]  # [BLOCK_N, BLOCK_K] E4M3 bytes
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        in_k = (k0 + tl.arange(0, BLOCK_K) < k_end)[None, :]
        if EVEN_K:
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0)
        else:
            w = tl.load(w_ptrs, mask=mask_n[:, None] & in_k, other=0)
        x = tl.load(x_ptrs, mask=mask_m[:, None] & in_k, other=0.0)
        w = w.to(tl.float8e4nv, bitcast=True).to(tl.float32) if NATIVE else _e4m3_bits_to_float(w)
        if DOT:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision="ieee" if x.dtype == tl.float32 else None)
        else:  # one row
            acc += tl.sum(w * x.to(tl.float32), axis=1)[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    offs = offs_m[:, None] * N + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    last = True
    if SPLIT:
        acc, last = sum_splits(acc, part_ptr, count_ptr, pid_n, split, tl.num_programs(1), M * N, offs, mask)
    if last:
        acc *= tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Up to FEW_ROWS rows run the Triton kernel; more are quantized for fp8_mm. On an
# H100 at 16 rows the kernel took 10.2-44.4 us on Qwen3-8B's four projection shapes
# against quantization + fp8_mm's 13.2-43.8, at 24 and 32 rows 15.7-48.2 against
# 13.3-43.8 (its 32-row tiles). The kernel takes up to 64.
FEW_ROWS, _MAX_ROWS = 16, 64
# (BLOCK_N, BLOCK_K, num_warps, num_stages) for one row (FMA) and for more rows
# (tl.dot), from benchmarks/fp8_kernel.py --sweep over Qwen3-8B's four projection
# shapes. One row: the fastest summed over the four on an H200, 65.9 us a layer
# against 83.9 for (4, 1024, 4, 1), the H100's choice among 512- and 1024-wide
# slices (each program's 8 KB of weights a slice in flight at once; the Qwen3-8B
# FP8 step at batch 1 went from 3.35 to 2.93 ms). More rows: the H100's fastest,
# on an H200 still the fastest at 8 and 16 rows except on a wide weight (below):
# there 64-wide tiles, 128 of K a slice, 4 stages took 29.5-29.7 us against 31.1-32.0
# on gate|up in the sweep (the whole layer timed on two other H200s: 31.4-31.6 against
# 31.7-32.4).
ROW_CONFIG, DOT_CONFIG, DOT_WIDE_CONFIG = (4, 2048, 4, 1), (32, 256, 4, 3), (64, 128, 4, 4)
PROGRAMS_PER_SM = 2  # the K splits aim for this many programs on each SM
# A weight is wide when it has this many 64-wide output tiles an SM or more (Qwen3-8B's
# gate|up: 384 on 132 SMs; its q|k|v, o and down 64 to 96): every SM has programs enough
# without splitting K, and the wide configs' larger tiles pay there.
WIDE_TILES_PER_SM = 2


def wide(n: int, device: torch.device) -> bool:
    """Whether an N-feature weight takes the wide configs (DOT_WIDE_CONFIG, MM_CONFIGS' wide ones) on device."""
    return triton.cdiv(n, 64) >= WIDE_TILES_PER_SM * num_sms(device)


def few_rows_config(m: int, n: int, device: torch.device) -> tuple:
    """fp8_few_rows' config at m rows on an N-feature weight."""
    return ROW_CONFIG if m == 1 else DOT_WIDE_CONFIG if wide(n, device) else DOT_CONFIG


def few_rows_tiles(n: int) -> int:
    """Output tiles of the few-rows kernel or fp8_mm on N features, at most (their split-K counters)."""
    return max(triton.cdiv(n, min(ROW_CONFIG[0], DOT_CONFIG[0], DOT_WIDE_CONFIG[0])),
               max(triton.cdiv(MM_ROWS, c[0]) * triton.cdiv(n, c[1])
                   for _, *configs in MM_CONFIGS for c in configs))


def fp8_few_rows(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 counts: torch.Tensor | None = None, config: tuple | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] E4M3 * weight_scale [N, 1])^T + bias, M <= 64, x not quantized;
    counts: the layer's split-K counters (kernels/splitk.py), zero between calls; config: as DOT_CONFIG,
    optionally with the programs an SM that K is split for (PROGRAMS_PER_SM if not), for benchmarks."""
    m, k = x.shape
    n = weight.shape[0]
    if not 0 < m <= _MAX_ROWS:
        raise ValueError(f"fp8_few_rows takes 1 to {_MAX_ROWS} rows, got {m}")
    block_n, block_k, warps, stages, *per_sm = config or few_rows_config(m, n, x.device)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(n, block_n)
    k_per_split, splits, part, counts = splitk.plan(tiles, k, block_k, (m, n), out, counts,
                                                    per_sm[0] if per_sm else PROGRAMS_PER_SM)
    # E4M3 passed as its bytes: the kernel reinterprets them (as the interpreter can too)
    _fp8_few_rows_kernel[(tiles, splits)](
        x, weight.view(torch.uint8), weight_scale, bias if bias is not None else weight_scale, out, part, counts,
        m, n, k, k_per_split, x.stride(0), DOT=m > 1, NATIVE=x.is_cuda, HAS_BIAS=bias is not None,
        SPLIT=splits > 1, EVEN_K=k % block_k == 0, BLOCK_M=max(16, triton.next_power_of_2(m)) if m > 1 else 1,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages, **pdl_args(x.device))
    return out


# Triton, for FEW_ROWS + 1 to MM_ROWS rows: x quantized per token first (as for
# _scaled_mm), then E4M3 x E4M3 on the tensor cores (fast accumulation, below), K split
# so that small N still fills the GPU (where cuBLAS's FP8 GEMM runs a tile per
# SM or fewer), and both scales applied to the sum. Program (n tile * m tiles +
# m tile, split); kernels/splitk.py adds the splits. A tile of fewer than 64
# tokens is multiplied as W x^T (SWAP), so the tokens are the MMA's N, which
# Hopper's wgmma takes down to 8, where its M is 64.
@triton.jit(do_not_specialize=["M"])
def _fp8_mm_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K, k_per_split,
                   HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PREFETCH: tl.constexpr, SWAP: tl.constexpr,
                   PDL: tl.constexpr):
    tile, split = tl.program_id(0), tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)  # an n tile's m tiles run side by side, sharing its weights in L2
    offs_m = (tile % tiles_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tile // tiles_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    k_start = split * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = xq_ptr + offs_m[:, None].to(tl.int64) * K + (k_start + offs_k)[None, :]  # [BLOCK_M, BLOCK_K] E4M3
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + (k_start + offs_k)[None, :]  # [BLOCK_N, BLOCK_K] E4M3
    if PREFETCH:  # each weight row's first PREFETCH bytes of the split, while the kernel before ends
        prefetch_l2(w_ptr + offs_n.to(tl.int64) * K + k_start,
                    tl.where(mask_n, tl.minimum(k_end - k_start, PREFETCH), 0))
    wait_for_previous(PDL)
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        in_k = (k0 + offs_k < k_end)[None, :]
        x = tl.load(x_ptrs, mask=mask_m[:, None] & in_k, other=0.0)
        w = tl.load(w_ptrs, mask=mask_n[:, None] & in_k, other=0.0)
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc)  # [BLOCK_N, BLOCK_M]
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWAP:
        acc = tl.trans(acc)
    offs = offs_m[:, None] * N + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    last = True
    if SPLIT:
        acc, last = sum_splits(acc, part_ptr, count_ptr, tile, split, tl.num_programs(1), M * N, offs, mask)
    if last:
        acc *= tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
        acc *= tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Up to MM_ROWS rows _fp8_mm_kernel, beyond them _scaled_mm. On an H100 (Qwen3-8B's
# projections, benchmarks/RESULTS.md) at 17 to 128 rows the kernel took 0.67-0.99x
# _scaled_mm's time (quantization included in both), at 256 rows up to 1.4x.
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, programs an SM), K split until every
# SM has about that many programs. MM_CONFIGS holds (up to this many rows, the config on a
# narrow weight, the config on a wide one), from a sweep on an H200 under fast accumulation
# (Qwen3-8B's four projections, quantization not counted; benchmarks/RESULTS.md, 2026-11-29):
# - up to 32 rows, tiles of 32 tokens (SWAP) on every weight (at 24 rows 68.9 us a layer against
#   76.6 with 64-token tiles, in an earlier sweep), 256 of K a slice, 3 stages: at 20, 28 and 32
#   rows as fast as or faster than 128 of K in 5 stages on each of the four shapes (70.6 us a
#   layer against 71.6 at 28 rows);
# - at 33 to 64 rows (one 64-token tile), 32-wide tiles with 256 of K on a narrow weight (o,
#   q|k|v, down: 70.9 us a layer against 77.2 at 64 rows); 64-wide, 128 of K, 4 stages on a wide
#   one (gate|up), where no other config was faster;
# - at 65 to 128 rows (two 64-token tiles, so twice the programs) the 32-wide tiles need a second
#   wave on q|k|v (20.4 us against 13.3 at 80 rows): 64-wide, 5 stages on a narrow weight, and
#   128-wide, 3 stages on a wide one (gate|up 35.4-36.5 us against 40.9-42.0).
# The community workload gains less: 6,642-6,655 tok/s against 6,619-6,624 with the configs
# before (the steps of 9 to 128 rows 0.3-1% faster).
MM_ROWS = 128
MM_CONFIGS = ((32, (32, 64, 256, 4, 3, 1), (32, 64, 256, 4, 3, 1)),
              (64, (64, 32, 256, 4, 4, 1), (64, 64, 128, 4, 4, 1)),
              (MM_ROWS, (64, 64, 128, 4, 5, 1), (64, 128, 128, 4, 3, 1)))
# Both FP8 GEMMs run with the tensor cores' fast accumulation: Hopper's tensor cores add E4M3
# products in an accumulator of less than float32's precision, and the whole of a split's K goes
# into it (as in the FP8 GEMMs of other serving engines). On an H200, on Qwen3-8B's shapes, that
# is 0.05-0.8% of the largest output off, against 0.011-0.022% with the sums made float32 every
# 128 of K (tl.dot's max_num_imprecise_acc, _scaled_mm without use_fast_accum): a few times a bf16
# output's own rounding (2^-9 of a value), a tenth of E4M3's (2^-4). The exact sums cost 0.5% in
# the community workload at 17 to 128 rows and, beyond them, 1.05-1.12x the GEMMs' time at 256 to
# 8,192 rows (benchmarks/RESULTS.md).
# Bytes of each weight row a program asks L2 for before it waits for the kernel before: only under PDL
# (Hopper and later, where cp.async.bulk.prefetch exists), the one case where that wait overlaps anything.
MM_PREFETCH = 512


def mm_config(m: int, n: int, device: torch.device) -> tuple:
    """fp8_mm's config at m (1 to MM_ROWS) rows on an N-feature weight."""
    if not 0 < m <= MM_ROWS:
        raise ValueError(f"fp8_mm's configs cover 1 to {MM_ROWS} rows, got {m}")
    narrow, wide_config = next(configs for rows, *configs in MM_CONFIGS if m <= rows)
    return wide_config if wide(n, device) else narrow


def fp8_mm(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           bias: torch.Tensor | None, out_dtype: torch.dtype, counts: torch.Tensor | None = None,
           config: tuple | None = None) -> torch.Tensor:
    """x_q [M, K] E4M3 (rows contiguous) @ weight [N, K] E4M3^T, times x_scale [M, 1] and weight_scale [N, 1]
    (float32), + bias -> [M, N] out_dtype; on a GPU, M <= MM_ROWS. counts: split-K counters, zero between calls;
    config: as MM_CONFIGS' (benchmarks compare others; mm_config's if none)."""
    m, k = x_q.shape
    n = weight.shape[0]
    if not 0 < m <= MM_ROWS:
        raise ValueError(f"fp8_mm takes 1 to {MM_ROWS} rows, got {m}")
    block_m, block_n, block_k, warps, stages, per_sm = config or mm_config(m, n, x_q.device)
    x_q = x_q.contiguous()
    out = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_per_split, splits, part, counts = splitk.plan(tiles, k, block_k, (m, n), out, counts, per_sm)
    launch = pdl_args(x_q.device)
    _fp8_mm_kernel[(tiles, splits)](
        x_q, x_scale, weight, weight_scale, bias if bias is not None else weight_scale, out, part, counts,
        m, n, k, k_per_split, HAS_BIAS=bias is not None, SPLIT=splits > 1, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, STAGES=stages, SWAP=block_m < 64, num_warps=warps, num_stages=stages,
        PREFETCH=MM_PREFETCH if launch["PDL"] and k % 16 == 0 and weight.data_ptr() % 16 == 0 else 0, **launch)
    return out


def fp8_quantized_linear(x_q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None, out_dtype: torch.dtype,
                         counts: torch.Tensor | None = None) -> torch.Tensor:
    """An FP8 layer on its input already quantized (x_q [M, K] E4M3, x_scale [M, 1] float32): fp8_mm up to
    MM_ROWS rows, _scaled_mm with its fast accumulation beyond."""
    if 0 < x_q.shape[0] <= MM_ROWS:
        return fp8_mm(x_q, x_scale, weight, weight_scale, bias, out_dtype, counts)
    # weight.t() is column-major, as _scaled_mm wants its second operand.
    return torch._scaled_mm(x_q, weight.t(), scale_a=x_scale, scale_b=weight_scale.t(), bias=bias,
                            out_dtype=out_dtype, use_fast_accum=True)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
               input_scale: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> torch.Tensor:
    """fp8_linear_ref's layer on a GPU: up to FEW_ROWS rows by fp8_few_rows (the activations
    unquantized, input_scale unused); more rows quantized (per token, or by input_scale)
    for fp8_quantized_linear."""
    if 0 < x.shape[0] <= FEW_ROWS and x.stride(-1) == 1:
        return fp8_few_rows(x, weight, weight_scale, bias, counts)
    x_q, x_scale = quantize_rows_triton(x) if input_scale is None else quantize_static(x, input_scale)
    return fp8_quantized_linear(x_q, x_scale, weight, weight_scale, bias, x.dtype, counts)
