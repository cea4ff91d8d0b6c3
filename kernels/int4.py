"""w4a16 linear layers: 4-bit weights with per-group scales and zero points.

The one layout for every int4 checkpoint (AWQ and GPTQ are repacked into it at load):
    qweight  int32 [K // 8, N]: element (k, n) is (qweight[k // 8, n] >> 4 * (k % 8)) & 0xF
    scales   [K // G, N] in the activation dtype
    zeros    [K // G, N] in the same dtype, integers (they come from 4-bit fields)
    W[n, k] = (q(k, n) - zeros[k // G, n]) * scales[k // G, n], G = group_size dividing K
and y = x W^T + bias. int4_linear_ref dequantizes W and calls F.linear;
int4_linear is one Triton kernel that dequantizes tiles on the fly (one row of a
16-bit model: kernels/int4_gemv.py).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from headrace import envs
from headrace.kernels import int4_mma, splitk
from headrace.kernels.device import pdl_args, wait_for_previous
from headrace.kernels.int4_gemv import CONFIG as GEMV_CONFIG, int4_gemv
from headrace.kernels.splitk import sum_splits

_SHIFTS = tuple(range(0, 32, 4))  # bit offset of k % 8 within an int32


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [K, N] integers 0..15 -> qweight int32 [K // 8, N]."""
    if q.dim() != 2 or q.dtype.is_floating_point or q.dtype == torch.bool:
        raise ValueError(f"pack_int4 takes a 2-d integer tensor, got {q.dtype} {tuple(q.shape)}")
    if q.shape[0] % 8:
        raise ValueError(f"pack_int4: K = {q.shape[0]} rows is not a multiple of 8")
    if q.numel() and (q.min() < 0 or q.max() > 15):
        raise ValueError("pack_int4: values must lie in 0..15")
    shifts = torch.tensor(_SHIFTS, device=q.device)[None, :, None]
    packed = (q.long().reshape(q.shape[0] // 8, 8, q.shape[1]) << shifts).sum(dim=1)  # [K // 8, N] in [0, 2^32)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """qweight int32 [K // 8, N] -> q uint8 [K, N]."""
    shifts = torch.tensor(_SHIFTS, device=qweight.device, dtype=torch.int32)[None, :, None]
    q = (qweight[:, None, :] >> shifts) & 0xF  # [K // 8, 8, N]
    return q.reshape(-1, qweight.shape[1]).to(torch.uint8)


def _check(qweight, scales, zeros, group_size: int, k: int | None = None) -> int:
    """Validates the layout (and the input width k if given); returns K."""
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-d int32 [K // 8, N], got {qweight.dtype} {tuple(qweight.shape)}")
    if k is not None and qweight.shape[0] * 8 != k:
        raise ValueError(f"qweight has {qweight.shape[0]} rows, so K = {qweight.shape[0] * 8}, but x has K = {k}")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if k == 0 or group_size <= 0 or k % group_size:
        raise ValueError(f"group_size {group_size} does not divide K = {k}")
    if group_size % 16 and group_size != k:
        raise ValueError(f"group_size {group_size} must be a multiple of 16 or K = {k}")
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != (k // group_size, n) or not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be floating [K // group_size, N] = [{k // group_size}, {n}], "
                             f"got {t.dtype} {tuple(t.shape)}")
    return k


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """-> W [N, K] in dtype: (q - zero) * scale in float32, then cast."""
    _check(qweight, scales, zeros, group_size)
    q = unpack_int4(qweight).float()  # [K, N]
    s = scales.float().repeat_interleave(group_size, dim=0)  # [K, N]
    z = zeros.float().repeat_interleave(group_size, dim=0)  # [K, N]
    return ((q - z) * s).to(dtype).t()


def _check_input(x, qweight, scales, zeros, group_size, bias) -> None:
    if x.dim() == 0:
        raise ValueError("x must have a last dimension of K features")
    _check(qweight, scales, zeros, group_size, x.shape[-1])
    if bias is not None and tuple(bias.shape) != (qweight.shape[1],):
        raise ValueError(f"bias must be [N] = [{qweight.shape[1]}], got {tuple(bias.shape)}")


def int4_linear_ref(
    x: torch.Tensor,  # [..., K] float16 / bfloat16 / float32
    qweight: torch.Tensor,  # [K // 8, N] int32
    scales: torch.Tensor,  # [K // G, N]
    zeros: torch.Tensor,  # [K // G, N]
    group_size: int,  # G
    bias: torch.Tensor | None,  # [N] in x's dtype
) -> torch.Tensor:
    _check_input(x, qweight, scales, zeros, group_size, bias)
    return F.linear(x, dequantize_int4(qweight, scales, zeros, group_size, x.dtype), bias)


# Triton: program (tile, split) computes a [BLOCK_M, BLOCK_N] tile of y from split's run of
# BLOCK_K-wide slices of K. A slice lies in one group (BLOCK_K divides G, or G = K), so it reads
# one row of scales and zeros. Each int32 of qweight is loaded once and widened in registers to its
# 8 rows j, one of two ways. It stays 3-d [BLOCK_K // 8, 8, BLOCK_N] until the reshape to
# [BLOCK_K, BLOCK_N], so each thread holds whole int32s.
# - 16-bit x on a GPU (WIDEN16): PTX (_widen16_asm) takes two weights at once. Shifts and a byte
#   permute put their nibbles at bits 0 and 16, and an AND-OR with the magic's bits makes the two
#   halves' float16 / bfloat16 values magic + q exactly. One packed FMA subtracts magic + zero
#   (exact: small integers) and, unless SCALE_ACC, another multiplies by the scale, rounding once
#   as the reference does. Compiled for sm_90 by Triton 3.6, the decode config's loop body took
#   274 instructions against 370 the float32 way (benchmarks/RESULTS.md).
# - otherwise (float32, and the Triton interpreter, which runs no PTX): (qw << 4 or qw >> 12) puts
#   row j's nibble at bit s = 4 + 4 * (j % 4); keeping it and the bits of 0x4B000000 gives the
#   float32 2^23 + q * 2^s, and that * 2^-s - (2^(23 - s) + zero) is q - zero exactly (zero is an
#   integer): one AND and one FMA per weight.
# The scale multiplies the widened tile (as the reference rounds) or, when few rows share the tile
# (SCALE_ACC), the dot's [BLOCK_M, BLOCK_N] result. With K split (SPLIT), kernels/splitk.py adds
# the programs' float32 partials [split_k, M, N] in a fixed order, so results are the same run to run.
@triton.jit
def _q_minus_zero(qw, zero):
    """qw int32 [R, 1, N], zero float32 [1, 1, N] -> q - zero float32 [R, 8, N], row 8 r + j of the slice at [r, j]."""
    j = tl.arange(0, 8)[None, :, None]
    nibble = 0xF << (4 + 4 * (j % 4))
    unit = ((123 - 4 * (j % 4)) << 23).to(tl.float32, bitcast=True)  # 2^-s
    magic = ((146 - 4 * (j % 4)) << 23).to(tl.float32, bitcast=True)  # 2^(23 - s)
    half = tl.where(j < 4, qw << 4, qw >> 12) | 0x4B000000  # rows 0..3 or 4..7 at bits 4..19
    bits = half & (nibble | 0x4B000000)
    return tl.fma(bits.to(tl.float32, bitcast=True), unit, -(magic + zero))


def _widen16_asm(ty: str, magic: int, one: int, scaled: bool) -> str:
    """PTX for two weights at once (which two is Triton's choice): $1, $2 their int32s; $3, $4 their
    byte selectors (byte j // 2 at nibble 0 for the first, 4 + j // 2 at nibble 2 for the second);
    $5, $6 their shifts 4 * (j % 2); $7 -(magic + zero) and $8 the scale, as ty's two halves
    -> $0: q - zero [* scale] as ty. ptxas folds the selectors and shifts, constants per register."""
    lines = ["{", ".reg .b32 a, b, sel, t, one, m0;", f"mov.b32 one, {one * 0x10001:#x};", "mov.b32 m0, 0x80008000;",
             "shr.u32 a, $1, $5;", "shr.u32 b, $2, $6;",
             "lop3.b32 sel, $3, $4, 0x000F, 0xE4;",  # nibble 0 of $3, the rest of $4
             "prmt.b32 t, a, b, sel;",  # the two nibbles at bits 0..3 and 16..19
             f"lop3.b32 t, t, 0x000F000F, {magic * 0x10001:#x}, 0xEA;",  # (t & mask) | magic
             f"fma.rn.{ty} t, t, one, $7;"]  # magic + q - (magic + zero)
    if scaled:
        lines.append(f"fma.rn.{ty} t, t, $8, m0;")  # * scale (+ -0: the product, rounded once)
    return "\n".join(lines + ["mov.b32 $0, t;", "}"])


# Magic 2^7 (bfloat16) and 2^10 (float16): there the unit in the last place is 1, so magic + q is exact.
_BF16_MAGIC, _F16_MAGIC = tl.constexpr(128.0), tl.constexpr(1024.0)
_WIDEN_BF16 = tl.constexpr(_widen16_asm("bf16x2", 0x4300, 0x3F80, scaled=False))
_WIDEN_BF16_SCALED = tl.constexpr(_widen16_asm("bf16x2", 0x4300, 0x3F80, scaled=True))
_WIDEN_F16 = tl.constexpr(_widen16_asm("f16x2", 0x6400, 0x3C00, scaled=False))
_WIDEN_F16_SCALED = tl.constexpr(_widen16_asm("f16x2", 0x6400, 0x3C00, scaled=True))


@triton.jit
def _widen16(qw, zero, scale, SCALED: tl.constexpr):
    """qw int32 [R, 1, N], zero and scale [1, 1, N] in a 16-bit dtype -> q - zero (times the scale if
    SCALED) [R, 8, N] in that dtype, row 8 r + j of the slice at [r, j]."""
    j = tl.arange(0, 8)[None, :, None]
    select = (j // 2) * 0x0101 + 0x0400  # byte j // 2 as the first of a pair (nibble 0) or the second (nibble 2)
    ty = scale.dtype
    if ty == tl.bfloat16:
        asm: tl.constexpr = _WIDEN_BF16_SCALED if SCALED else _WIDEN_BF16
        magic: tl.constexpr = _BF16_MAGIC
    else:
        asm: tl.constexpr = _WIDEN_F16_SCALED if SCALED else _WIDEN_F16
        magic: tl.constexpr = _F16_MAGIC
    neg_zm = (-(zero.to(tl.float32) + magic)).to(ty)
    return tl.inline_asm_elementwise(asm, "=r,r,r,r,r,r,r,r,r", [qw, select, 4 * (j % 2), neg_zm, scale], dtype=ty,
                                     is_pure=True, pack=2)


@triton.jit(do_not_specialize=["M"])
def _int4_linear_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
                        k_per_split, stride_xm,
                        GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                        SCALE_ACC: tl.constexpr, WIDEN16: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    pid, split = tl.program_id(0), tl.program_id(1)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * tiles_n)) * GROUP_M  # GROUP_M row tiles share the weight tiles they read
    rows_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_m
    pid_n = (pid % (GROUP_M * tiles_n)) // rows_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    k_start = split * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    offs_k8 = k_start // 8 + tl.arange(0, BLOCK_K // 8)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    qw_ptrs = qw_ptr + offs_k8[:, None, None].to(tl.int64) * N + offs_n[None, None, :]  # [BLOCK_K // 8, 1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            qw = tl.load(qw_ptrs, mask=mask_n[None, None, :], other=0)
        else:
            in_k8 = offs_k8 < (k_end - k0 + k_start) // 8
            x = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k < k_end - k0 + k_start)[None, :], other=0.0)
            qw = tl.load(qw_ptrs, mask=in_k8[:, None, None] & mask_n[None, None, :], other=0)
        g_off = (k0 // GROUP if GROUP else 0) * N + offs_n[None, None, :]  # [1, 1, BLOCK_N]
        zero = tl.load(z_ptr + g_off, mask=mask_n[None, None, :], other=0.0)
        scale = tl.load(s_ptr + g_off, mask=mask_n[None, None, :], other=0.0)
        if WIDEN16:
            w = _widen16(qw, zero.to(x.dtype), scale.to(x.dtype), not SCALE_ACC)  # [BLOCK_K // 8, 8, BLOCK_N]
        else:
            w = _q_minus_zero(qw, zero.to(tl.float32))  # [BLOCK_K // 8, 8, BLOCK_N]
            if not SCALE_ACC:
                w = w * scale.to(tl.float32)
        w = tl.reshape(w, (BLOCK_K, BLOCK_N)).to(x.dtype)
        if SCALE_ACC:
            part = tl.dot(x, w, input_precision="ieee" if IEEE else None)
            acc += part * tl.reshape(scale.to(tl.float32), (1, BLOCK_N))
        else:
            acc = tl.dot(x, w, acc, input_precision="ieee" if IEEE else None)
        x_ptrs += BLOCK_K
        qw_ptrs += (BLOCK_K // 8) * N
    out_offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    last = True
    if SPLIT:
        acc, last = sum_splits(acc, part_ptr, count_ptr, pid, split, tl.num_programs(1), M * N, out_offs, mask)
    if last:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


class _Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int  # at most G's largest power-of-two divisor (G = K: any)
    num_warps: int
    num_stages: int
    scale_acc: bool  # scale the dot's result (few rows) rather than the dequantized tile
    split_k: int = 0  # 0: enough K splits to give every SM about PROGRAMS_PER_SM programs
    max_regs: int | None = None  # registers per thread, so two programs fit on an SM


# By the largest M of each bucket, the fastest of benchmarks/int4_kernel.py's candidates on an H100.
# Decode (M <= 16) is bound by reading and widening the weights: few rows a tile, K split so every SM
# has programs; 128 outputs a tile over 8 warps (at 4 and 16 rows 84-87 us for a Qwen3-8B layer's four
# projections, against 102 with 64 over 4 warps). Prefill is bound by the tensor cores: large tiles,
# so a widened tile serves many rows, and two programs per SM, one widening its tile while the other
# multiplies. block_n stays below the thread count (32 * num_warps): beyond it Triton gives the zero
# and scale loads one element per thread, the dequantization follows that layout and its
# shared-memory stores stop being vectorized.
_CONFIGS = (
    (16, _Config(16, 128, 128, 8, 3, True)),
    (32, _Config(32, 64, 128, 4, 3, False)),
    (64, _Config(64, 64, 128, 4, 3, False)),
    (128, _Config(128, 64, 64, 4, 3, False)),
    (256, _Config(128, 64, 64, 4, 3, False)),
    (None, _Config(128, 128, 64, 8, 3, False, 1, 128)),
)
PROGRAMS_PER_SM = 2  # the K splits of a config with split_k 0 aim for this many programs on each SM


def _pick_config(m: int) -> _Config:
    return next(cfg for limit, cfg in _CONFIGS if limit is None or m <= limit)


def _launch(x: torch.Tensor, qweight, scales, zeros, group_size: int, bias, cfg: _Config,
            counts: torch.Tensor | None = None) -> torch.Tensor:
    """int4_linear on a 2-d x [M, K] with the given tiles (benchmarks compare configs through it)."""
    m, k = x.shape
    n = qweight.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_k = min(cfg.block_k, max(16, triton.next_power_of_2(k)))
    if group_size != k:
        block_k = min(block_k, group_size & -group_size)  # a power of two dividing G, >= 16
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    k_per_split, splits, part, counts = splitk.plan(tiles, k, block_k, (m, n), out, counts, PROGRAMS_PER_SM,
                                                    cfg.split_k)
    _int4_linear_kernel[(tiles, splits)](
        x, qweight, scales, zeros, bias if bias is not None else scales, out, part, counts, m, n, k,
        k_per_split, x.stride(0), GROUP=0 if group_size == k else group_size,
        HAS_BIAS=bias is not None, SPLIT=splits > 1, EVEN_K=k % block_k == 0, SCALE_ACC=cfg.scale_acc,
        WIDEN16=x.is_cuda and x.dtype != torch.float32, IEEE=x.dtype == torch.float32, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **({"maxnreg": cfg.max_regs} if cfg.max_regs else {}), **pdl_args(x.device))
    return out


def split_k_tiles(n: int) -> int:
    """The most output tiles a split-K launch on N features has (its counters, kernels/splitk.py)."""
    return max([triton.cdiv(limit, cfg.block_m) * triton.cdiv(n, cfg.block_n)
                for limit, cfg in _CONFIGS if limit is not None and limit < DEQUANTIZE_ROWS]
               + [triton.cdiv(n, GEMV_CONFIG[0])])


# Triton, for many rows: program (k tile, n tile) writes W^T [BLOCK_K8 * 8, BLOCK_N]
# dequantized as the reference does ((q - zero) * scale in float32, then the
# model dtype), one of the 8 rows of each int32 at a time; cuBLAS multiplies.
@triton.jit
def _dequantize_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, group_size, BLOCK_K8: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_k8 = tl.program_id(0) * BLOCK_K8 + tl.arange(0, BLOCK_K8)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_k8 < tl.num_programs(0) * BLOCK_K8)[:, None] & (offs_n < N)[None, :]
    qw = tl.load(qw_ptr + offs_k8[:, None].to(tl.int64) * N + offs_n[None, :], mask=mask, other=0)
    for j in tl.static_range(8):
        k = offs_k8 * 8 + j
        g_off = (k // group_size)[:, None].to(tl.int64) * N + offs_n[None, :]
        zero = tl.load(z_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(s_ptr + g_off, mask=mask, other=0.0).to(tl.float32)
        w = (((qw >> (4 * j)) & 0xF).to(tl.float32) - zero) * scale
        tl.store(w_ptr + k[:, None].to(tl.int64) * N + offs_n[None, :], w.to(w_ptr.dtype.element_ty), mask=mask)


# From this many rows on, dequantizing W once and multiplying with cuBLAS
# beats the fused kernel. On an H100 (benchmarks/int4_kernel.py, Qwen3-8B's
# shapes) at 512 rows it took 1.5-1.7x the bf16 GEMM's time against 1.8-2.4x,
# and at 2048 rows 1.1-1.2x against 1.8x. At 256 rows the fused kernel wins.
DEQUANTIZE_ROWS = 512


def dequantize_int4_triton(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                           dtype: torch.dtype) -> torch.Tensor:
    """dequantize_int4's W, as W^T [K, N] (contiguous), in one launch."""
    k8, n = qweight.shape
    w_t = torch.empty((k8 * 8, n), dtype=dtype, device=qweight.device)
    block_k8, block_n = 4, 128
    if k8 % block_k8:
        block_k8 = 1
    _dequantize_kernel[(k8 // block_k8, triton.cdiv(n, block_n))](qweight, scales, zeros, w_t, n, group_size,
                                                                   BLOCK_K8=block_k8, BLOCK_N=block_n)
    return w_t


def mma_rows(x: torch.Tensor, qweight: torch.Tensor, group_size: int) -> bool:
    """Whether x [rows, K]'s call goes to kernels/int4_mma.py: 2..8 rows of a 16-bit model on an sm_90 GPU
    (one row: kernels/int4_gemv.py), unless HEADRACE_INT4_MMA=0."""
    return x.dim() == 2 and x.shape[0] > 1 and int4_mma.usable(x, qweight, group_size) and envs.int4_mma()


def gated_rows(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
               bias: torch.Tensor | None, counts: torch.Tensor | None) -> torch.Tensor:
    """silu_and_mul(int4_linear(x, ...)) in one launch for one 16-bit row or mma_rows(x): a gate|up projection,
    the gate the first half of the outputs."""
    if x.shape[0] == 1:
        return int4_gemv(x, qweight, scales, zeros, group_size, bias, counts, gated=True)
    return int4_mma.int4_mma(x, qweight, scales, zeros, group_size, bias, counts, gated=True)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, bias: torch.Tensor | None, counts: torch.Tensor | None = None) -> torch.Tensor:
    """int4_linear_ref's result in one launch (two from DEQUANTIZE_ROWS rows; one 16-bit row: int4_gemv; 2..8
    on tensor cores: mma_rows);
    x's last dimension must be contiguous.
    counts: the layer's split-K counters (split_k_tiles(N) of them, zero between calls)."""
    _check_input(x, qweight, scales, zeros, group_size, bias)
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.stride(-1) != 1:
        raise ValueError("x must be contiguous in its last dimension")
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if x2.shape[0] == 1 and x.dtype != torch.float32:  # one row of a 16-bit model: kernels/int4_gemv.py
        out = int4_gemv(x2, qweight, scales, zeros, group_size, bias, counts)
    elif mma_rows(x2, qweight, group_size):
        out = int4_mma.int4_mma(x2, qweight, scales, zeros, group_size, bias, counts)
    elif x2.shape[0] >= DEQUANTIZE_ROWS:
        out = x2 @ dequantize_int4_triton(qweight, scales, zeros, group_size, x.dtype)
        out = out if bias is None else out + bias
    else:
        out = _launch(x2, qweight, scales, zeros, group_size, bias, _pick_config(x2.shape[0]), counts)
    return out.reshape(*x.shape[:-1], qweight.shape[1])
