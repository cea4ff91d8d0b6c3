"""Few-row projections on float weights, with their neighbours folded in: torch reference and Triton kernel.

At decode sizes a projection reads its whole weight for a few rows of
arithmetic, and the kernels beside it (the RMSNorm before q|k|v and gate|up,
SiLU-and-multiply after gate|up) each cost a launch and a round trip of the
activations. dense_linear does the projection in one launch with them inside:
- norm: the input is RMSNorm(x + residual), rounded as kernels/norm.py rounds;
  each program finds the rows' rstd in a first pass, then normalises its own
  slice of K as it loads it. The sum x + residual is written once, as the next
  residual, into a new tensor (residual itself is never written).
- gated: the weight is gate|up, [2 * d, K]; the output is silu(gate) * up,
  [M, d], rounded as kernels/activation.py rounds.
The reference is the model's own sequence of steps.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from headrace.kernels import splitk
from headrace.kernels.activation import silu_and_mul_ref, silu_mul
from headrace.kernels.device import pdl_args, wait_for_previous
from headrace.kernels.norm import cast_rtne, prenorm, rms_norm_ref
from headrace.kernels.splitk import sum_splits


def dense_linear_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K], or gate|up [2 * d, K] when gated
    bias: torch.Tensor | None,  # [N]
    norm: tuple[torch.Tensor, float] | None = None,  # (RMSNorm weight [K], eps) applied to the input first
    residual: torch.Tensor | None = None,  # [M, K]: normalise x + residual (norm only)
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the layer's output [M, N] or [M, d], the next residual: x + residual, x
    without one, None without norm)."""
    new_residual = None
    if norm is not None:
        x, new_residual = prenorm(rms_norm_ref, x, *norm, residual)
    y = F.linear(x, weight, bias)
    return (silu_and_mul_ref(y) if gated else y), new_residual


# Triton: program (n tile, split) multiplies ROWS weight rows by its split's run
# of K (kernels/splitk.py adds the splits). Without DOT (fma_path): FMAs in
# float32. One row is summed along K at each slice; a few (on a narrow weight)
# take each weight slice once and multiply it into one row's sums after
# another, each lane keeping its own sums along K ([BLOCK_M, ROWS, BLOCK_K //
# _LANE_K]) until they are added across lanes once, at the end. With DOT:
# tl.dot, the rows padded to 16 or 32. Gated, a
# tile's weight rows interleave gate and up (gate c, up c, gate c + 1, ...),
# so a program holds both halves of its ROWS // 2 output columns.
_LANE_K = tl.constexpr(8)  # without DOT, each lane sums its own runs of this much of K until the end


@triton.jit
def _normed(x, res_ptr, new_res_ptr, nw_ptr, rstd, offs_m, offs_k, mask, K, WRITE_RES,
            HAS_RES: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] at (offs_m, offs_k) -> RMSNorm(x + residual) there, in x's dtype."""
    dtype = x.dtype
    if HAS_RES:
        r = tl.load(res_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask, other=0.0)
        x = cast_rtne(x.to(tl.float32) + r.to(tl.float32), dtype)
        if WRITE_RES:
            tl.store(new_res_ptr + offs_m[:, None] * K + offs_k[None, :], x, mask=mask)
    nw = tl.load(nw_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    return cast_rtne(nw[None, :] * cast_rtne(x.to(tl.float32) * rstd[:, None], dtype).to(tl.float32), dtype)


@triton.jit
def _x_slice(x_ptr, stride_xm, rows, rstd, offs_k, in_k, M, K, res_ptr, new_res_ptr, nw_ptr, WRITE_RES,
             NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """x's rows [R] over the slice offs_k [BLOCK_K] (in_k: inside the split), normed with their rstd [R]
    under NORM -> [R, BLOCK_K] in x's dtype."""
    mask = (rows < M)[:, None] & in_k[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    if NORM:
        x = _normed(x, res_ptr, new_res_ptr, nw_ptr, rstd, rows, offs_k, mask, K, WRITE_RES, HAS_RES)
    return x


@triton.jit(do_not_specialize=["M"])
def _dense_kernel(x_ptr, res_ptr, new_res_ptr, nw_ptr, eps, w_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
                  M, N, K, k_per_split, stride_xm,
                  NORM: tl.constexpr, HAS_RES: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                  DOT: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
                  BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr,
                  EARLY: tl.constexpr = False):
    pid_n, split = tl.program_id(0), tl.program_id(1)
    dtype = x_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    r = tl.arange(0, ROWS)
    if GATED:  # N is d; output column and weight row of each tile row
        col = pid_n * (ROWS // 2) + r // 2
        w_row = col + (r % 2) * N
    else:
        col = pid_n * ROWS + r
        w_row = col
    mask_r = col < N
    if EARLY:  # the whole of K is one slice (one split): its weights before the wait, as they land
        offs_k = tl.arange(0, BLOCK_K)
        w_early = tl.load(w_ptr + w_row[:, None].to(tl.int64) * K + offs_k[None, :],
                          mask=mask_r[:, None] & (offs_k < K)[None, :], other=0.0)
    wait_for_previous(PDL)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM:  # the rows' sum of squares over all of K
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, NORM_BLOCK):
            offs_k = k0 + tl.arange(0, NORM_BLOCK)
            mask = mask_m[:, None] & (offs_k < K)[None, :]
            s = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
            if HAS_RES:
                res = tl.load(res_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask, other=0.0)
                s = cast_rtne(s.to(tl.float32) + res.to(tl.float32), dtype)
            s = s.to(tl.float32)
            ss += tl.sum(s * s, axis=1)
        rstd = tl.rsqrt(ss / K + eps)
    k_start = split * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    acc = tl.zeros([BLOCK_M, ROWS], dtype=tl.float32)
    lanes = tl.zeros([BLOCK_M, ROWS, BLOCK_K // _LANE_K], dtype=tl.float32)  # a few rows: sums along K by lane
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < k_end
        if DOT or BLOCK_M == 1:
            x = _x_slice(x_ptr, stride_xm, offs_m, rstd, offs_k, in_k, M, K, res_ptr, new_res_ptr, nw_ptr, pid_n == 0,
                         NORM, HAS_RES)
        w_ptrs = w_ptr + w_row[:, None].to(tl.int64) * K + offs_k[None, :]
        if EARLY:
            w = w_early
        elif EVEN_K:
            w = tl.load(w_ptrs, mask=mask_r[:, None], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=mask_r[:, None] & in_k[None, :], other=0.0)
        if DOT:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee" if x.dtype == tl.float32 else None)
        elif BLOCK_M == 1:  # one row: summed along K at each slice
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
        else:  # a few rows: each weight multiplied into every row's sums in turn, read once
            wf = tl.reshape(w.to(tl.float32), [ROWS, BLOCK_K // _LANE_K, _LANE_K])
            for m in tl.static_range(BLOCK_M):
                row = m + tl.arange(0, 1)  # [1]
                rstd_m = tl.zeros([1], dtype=tl.float32)
                if NORM:
                    rstd_m += tl.sum(tl.where(offs_m == m, rstd, 0.0), axis=0)
                x = _x_slice(x_ptr, stride_xm, row, rstd_m, offs_k, in_k, M, K, res_ptr, new_res_ptr, nw_ptr,
                             pid_n == 0, NORM, HAS_RES)
                x = tl.reshape(x.to(tl.float32), [1, BLOCK_K // _LANE_K, _LANE_K])
                part = tl.sum(wf * x, axis=2)  # [ROWS, BLOCK_K // _LANE_K]: each lane's own run of K
                lanes = tl.where((offs_m == m)[:, None, None], lanes + part[None, :, :], lanes)
    if not DOT and BLOCK_M > 1:
        acc = tl.sum(lanes, axis=2)
    width = 2 * N if GATED else N  # of the float32 partials, gated columns interleaved as the rows are
    offs_p = offs_m[:, None] * width + (pid_n * ROWS + r)[None, :]
    mask_p = mask_m[:, None] & mask_r[None, :]
    last = True
    if SPLIT:
        acc, last = sum_splits(acc, part_ptr, count_ptr, pid_n, split, tl.num_programs(1), M * width, offs_p, mask_p)
    if last:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + w_row, mask=mask_r, other=0.0).to(tl.float32)[None, :]
        y = cast_rtne(acc, dtype)  # the projection's output, in the model dtype
        if GATED:
            gate, up = tl.split(tl.reshape(y.to(tl.float32), [BLOCK_M, ROWS // 2, 2]))
            cols = pid_n * (ROWS // 2) + tl.arange(0, ROWS // 2)
            tl.store(out_ptr + offs_m[:, None] * N + cols[None, :], silu_mul(gate, up, dtype),
                     mask=mask_m[:, None] & (cols < N)[None, :])
        else:
            tl.store(out_ptr + offs_m[:, None] * N + col[None, :], y, mask=mask_p)


# Up to FEW_ROWS rows the model runs the kernel; more go to cuBLAS (after a
# separate norm and before a separate activation). On an H100 the kernel beat
# norm + cuBLAS + SiLU at one row on every Qwen3-0.6B projection, but with the
# norm folded in it took twice their time at 2 to 16 rows (benchmarks/dense_kernel.py).
# A projection with nothing folded in (o, down) of at most PLAIN_N weight rows runs the
# kernel up to PLAIN_ROWS rows (max_rows): in a chain of Qwen3-0.6B layers at 4 and 8 rows,
# o and down through it and q|k|v and gate|up through cuBLAS took 28.2 us a layer against
# 28.9-31.6 all through cuBLAS, and the batch-8 decode step 3.5-4.4% less time. On
# Qwen3-8B's o and down (4096 rows) it was 0.5-1 us slower than cuBLAS.
# (ROWS, BLOCK_K, num_warps, num_stages) for more rows (tl.dot); row_config without it.
# Without tl.dot (fma_path), every weight slice is loaded once and multiplied into one row's
# per-lane sums after another. On an H100 (Qwen3-0.6B shapes) that beat the tl.dot path and
# cuBLAS on a narrow weight: o at 2, 4 and 8 rows 3.2, 3.6 and 4.9 us against 5.9-6.2, down
# at 2 and 4 rows 5.0 and 5.1 against 6.8-7.4 (benchmarks/RESULTS.md); down at 8 rows (whose
# per-lane sums then fill 64 registers a thread) took 7.5 against 6.8. On wider weights (8 rows a program, norm and SiLU
# folded in where the model folds them) it took 1.15-4.8x as long as cuBLAS with the norm and
# SiLU as kernels of their own, from 2 rows up.
FEW_ROWS, PLAIN_ROWS, PLAIN_N, _MAX_ROWS = 1, 8, 2048, 32
FMA_ROWS = 8  # the most rows fma_path sends past tl.dot
# Up to EARLY_ROWS rows, a narrow weight (at most PLAIN_N rows) taken whole-K in one slice is read before the PDL
# wait (EARLY), arriving while the kernel before ends: on an H100, Qwen3-0.6B's o at one row 2.5-2.9 us against
# 3.2-3.3 and down at one and two rows 3.2 and 3.6-3.7 against 3.9-4.1 and 4.9-5.1; o at 8 rows and down at 4
# were slower so (5.4-5.8 against 4.6-5.1, 5.6 against 5.0-5.1), and wide weights were slower at one row.
EARLY_ROWS = 2
FMA_ELEMENTS = 16384  # the most padded rows x BLOCK_K it sends there (per-lane sums: 32 registers a thread)
DOT_CONFIG = (32, 256, 4, 3)
PROGRAMS_PER_SM = 2  # the K splits aim for this many programs on each SM
_NORM_ELEMENTS = 4096  # per program and pass of the norm's first pass (registers: 32 a thread at 4 warps)
_ROW_K = 4096  # the most of K one program holds at one row
_ROW_ELEMENTS = 16384  # a one-row program's weight rows x K on a narrow weight (128 a thread at 4 warps)


def row_config(n_rows: int, k: int, gated: bool = False, m: int = 1,
               normed: bool = False) -> tuple[int, int, int, int]:
    """(ROWS, BLOCK_K, num_warps, num_stages) without tl.dot (fma_path), for m rows on a weight of n_rows x k.
    A narrow weight (at most PLAIN_N rows: o and down of Qwen3-0.6B) takes up to 4096 of K in one slice, so that
    each program issues all its weight loads at once and there are enough programs to need no K split (which adds
    a partial's store, a count and the sum's loads); at one row a program takes as many weight rows as
    _ROW_ELEMENTS holds, at more 2 (their per-lane sums must fit too). A wide one with a short K takes it in one
    slice too, 8 rows a program (16 gated); wider and longer weights (Qwen3-8B's q|k|v and gate|up) were slower
    so (27.8 and 92.0 us against 24.7 and 79.0 for norm + cuBLAS + SiLU on an H100) and keep 512-wide slices, 16
    rows a program at 8 warps with the norm in (normed) or gated; without (Qwen3-8B's o and down) one row a program
    takes up to 4096 of K a slice at 8 warps and 3 stages. On an H200 that took the four from 124.7-126.5 us a layer to
    113.3-113.9, against 8 rows, 512-wide slices and 4 warps for all (benchmarks/RESULTS.md).
    On an H100, 2 rows a program and K whole took Qwen3-0.6B's o and down from 6.5 and 7.2 us to 3.3 and 4.0 at
    one row; on an H200 (benchmarks/RESULTS.md) o at 8 rows a program took 2.0 us against 2.3, down at 4 2.6
    against 2.7 and gate|up at 16 6.1-6.3 against 6.5, and the one-row decode step 0.752-0.757 ms against
    0.792-0.793."""
    whole_k = min(_ROW_K, max(16, triton.next_power_of_2(k)))
    if n_rows <= PLAIN_N:
        return (2 if m > 1 else max(2, min(8, _ROW_ELEMENTS // whole_k))), whole_k, 4, 1
    if k <= 1024:
        return (16 if gated else 8), whole_k, 8, 1
    return (16, 512, 8, 1) if normed or gated else (1, whole_k, 8, 3)


def fma_path(m: int, n_rows: int, k: int) -> bool:
    """Whether m rows on a weight of n_rows x k run without tl.dot: always at one row; up to FMA_ROWS rows on a
    narrow weight (at most PLAIN_N rows) while the rows' per-lane sums stay small."""
    return m == 1 or (m <= FMA_ROWS and n_rows <= PLAIN_N
                      and triton.next_power_of_2(m) * row_config(n_rows, k, m=m)[1] <= FMA_ELEMENTS)


def max_rows(n_rows: int, plain: bool) -> int:
    """The most rows the model sends the kernel for a weight of n_rows: PLAIN_ROWS for a projection with no
    norm or activation folded in (plain) and at most PLAIN_N weight rows, else FEW_ROWS."""
    return PLAIN_ROWS if plain and n_rows <= PLAIN_N else FEW_ROWS


def split_k_tiles(n: int) -> int:
    """The split-K counters a layer of n weight rows keeps: the output tiles of a launch at m > 1 rows, at most
    (the fewest rows a program there). At one row a wide weight with a long K takes one row a program (row_config),
    more than PLAIN_N tiles, which splitk.plan splits only on a GPU of over PLAIN_N / PROGRAMS_PER_SM SMs; a launch
    that finds too few counters takes fresh ones (splitk.counters_for)."""
    return triton.cdiv(n, min(row_config(n, 1, m=2)[0], DOT_CONFIG[0]))


def dense_linear(
    x: torch.Tensor,  # [M, K], rows contiguous
    weight: torch.Tensor,  # [N, K] contiguous, x's dtype
    bias: torch.Tensor | None,
    norm: tuple[torch.Tensor, float] | None = None,  # weight [K] in x's dtype, eps
    residual: torch.Tensor | None = None,  # [M, K] contiguous
    gated: bool = False,
    counts: torch.Tensor | None = None,  # split-K counters (kernels/splitk.py), zero between calls
    config: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dense_linear_ref in one launch, for 1 to 32 rows."""
    m, k = x.shape
    rows = weight.shape[0]
    if not 0 < m <= _MAX_ROWS:
        raise ValueError(f"dense_linear takes 1 to {_MAX_ROWS} rows, got {m}")
    assert weight.shape[1] == k and weight.is_contiguous() and x.stride(1) == 1 and weight.dtype == x.dtype
    assert not gated or rows % 2 == 0
    n = rows // 2 if gated else rows
    fma = fma_path(m, rows, k)
    block_rows, block_k, warps, stages = config or (row_config(rows, k, gated, m, norm is not None) if fma
                                                   else DOT_CONFIG)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    block_m = triton.next_power_of_2(m) if fma else max(16, triton.next_power_of_2(m))
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    new_residual = None
    if norm is not None:
        assert norm[0].shape == (k,) and norm[0].dtype == x.dtype
        if residual is None:
            new_residual = x
        else:
            assert residual.shape == x.shape and residual.is_contiguous() and residual.dtype == x.dtype
            new_residual = torch.empty_like(residual)
    tiles = triton.cdiv(rows, block_rows)
    # the partials hold every weight row (gated: twice out's columns)
    k_per_split, splits, part, counts = splitk.plan(tiles, k, block_k, (m, rows), out, counts, PROGRAMS_PER_SM)
    _dense_kernel[(tiles, splits)](
        x, residual if residual is not None else x, new_residual if residual is not None else x,
        norm[0] if norm is not None else x, norm[1] if norm is not None else 0.0,
        weight, bias if bias is not None else x, out, part, counts,
        m, n, k, k_per_split, x.stride(0),
        NORM=norm is not None, HAS_RES=residual is not None, GATED=gated, HAS_BIAS=bias is not None,
        DOT=not fma, SPLIT=splits > 1, EVEN_K=k % block_k == 0, BLOCK_M=block_m, ROWS=block_rows, BLOCK_K=block_k,
        EARLY=fma and m <= EARLY_ROWS and block_k >= k and rows <= PLAIN_N,  # block_k >= k: one split
        NORM_BLOCK=min(triton.next_power_of_2(k), max(16, _NORM_ELEMENTS // block_m)),
        num_warps=warps, num_stages=stages, **pdl_args(x.device))
    return out, new_residual
