"""One row of a w4a16 linear layer (decode at batch 1), without tensor cores.

kernels/int4.py's layout and reference; int4_linear sends it one-row calls with
16-bit activations. At one row its tl.dot kernel pads the row to 16 and passes
each dequantized tile through shared memory; this kernel instead turns each
4-bit weight into a float32 factor with one logic op and multiplies it into the
sum with one FMA, and every program reads its weights with no stage between.

The trick: a nibble q placed at bits p..p+3 of a float32 whose exponent field
says 2^(23 - p) is the float 2^(23 - p) (1 + q 2^p 2^-23) = 2^(23 - p) + q,
exactly. With p = 12 or 16 (after at most one shift of the int32, or a swap of
its halves), one FMA with x_j adds (2^(23 - p) + q) x_j: the weight plus a known
offset of 2^11 or 2^7 times x_j. Each row of a tile starts its sum at -(sum_j
offset_j x_j + zero sum_j x_j), so after the eight FMAs it holds sum_j (q_j -
zero) x_j; the group's scale multiplies that once. The offsets cost precision
only against float32 inputs (float32 keeps the tl.dot kernel): in a 16-bit model
the sums stay within a few float32 ulps of 2^11 |x|, far below the 16-bit
rounding of W and y that the reference makes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from headrace.kernels import splitk
from headrace.kernels.activation import silu_mul
from headrace.kernels.device import pdl_args, wait_for_previous
from headrace.kernels.norm import cast_rtne
from headrace.kernels.splitk import sum_splits

# (lop3 0xEA: (a & b) | c) the nibble at bits 12..15 or 16..19, with 2^11's or 2^7's exponent field
_NIBBLE12 = tl.constexpr("lop3.b32 $0, $1, 0x0000F000, 0x45000000, 0xEA;")
_NIBBLE16 = tl.constexpr("lop3.b32 $0, $1, 0x000F0000, 0x43000000, 0xEA;")


@triton.jit
def _factor(word, P: tl.constexpr, ASM: tl.constexpr):
    """int32 word -> float32 2^(23 - P) + the nibble at bits P..P+3, P = 12 or 16."""
    if ASM:  # one instruction; Triton's and + or come out as two
        asm: tl.constexpr = _NIBBLE12 if P == 12 else _NIBBLE16
        bits = tl.inline_asm_elementwise(asm, "=r,r", [word], dtype=tl.int32, is_pure=True, pack=1)
    else:  # the interpreter runs no PTX
        bits = (word & (0xF << P)) | ((150 - P) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _rot16(word, ASM: tl.constexpr):
    """word with its halves swapped: bits 0..3 to 16..19, bits 28..31 to 12..15."""
    if ASM:  # one byte permute
        word = tl.inline_asm_elementwise("prmt.b32 $0, $1, $1, 0x1032;", "=r,r", [word], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        word = (word << 16) | ((word >> 16) & 0xFFFF)
    return word


@triton.jit
def _load_slice(qw_ptrs, s_ptr, z_ptr, k0, k_end, r, offs_n, mask_n, N, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
                EVEN_N: tl.constexpr, ROW_GROUPS: tl.constexpr):
    """The weights of the slice at k0, whose int32s are at qw_ptrs [BLOCK_K // 8, C]: (qw [BLOCK_K // 8, C]
    int32, zero, scale float32: [1, C] for a slice in one group, [BLOCK_K // 8, C] under ROW_GROUPS, where the
    slice spans groups and each int32 row (8 of K, in one group) takes its own)."""
    if ROW_GROUPS:
        g = ((k0 + r * 8) // GROUP)[:, None] * N + offs_n[None, :]
    else:
        g = ((k0 // GROUP if GROUP else 0) * N + offs_n)[None, :]
    if EVEN_N and EVEN_K:  # no masks
        qw = tl.load(qw_ptrs)
        zero = tl.load(z_ptr + g).to(tl.float32)
        scale = tl.load(s_ptr + g).to(tl.float32)
    else:
        in_k = r < (k_end - k0) // 8 if not EVEN_K else r >= 0  # [BLOCK_K // 8] int32 rows inside the split
        mask = in_k[:, None] & mask_n[None, :]
        qw = tl.load(qw_ptrs, mask=mask, other=0)
        mask_g = mask if ROW_GROUPS else mask_n[None, :]
        zero = tl.load(z_ptr + g, mask=mask_g, other=0.0).to(tl.float32)
        scale = tl.load(s_ptr + g, mask=mask_g, other=0.0).to(tl.float32)
    return qw, zero, scale


@triton.jit
def _x_pair(x32_ptr, offs, in_k, J: tl.constexpr, BF16: tl.constexpr):
    """x_{2J}, x_{2J+1} as float32 from one 32-bit load of the 16-bit pair (little-endian: x_{2J} low)."""
    w = tl.load(x32_ptr + offs + J, mask=in_k, other=0)
    if BF16:  # a bfloat16 is a float32's upper half
        return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)
    lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dot8(qw, zero, scale, xs, minus_sum, base, acc, ASM: tl.constexpr):
    """acc plus scale * sum_j (q_j - zero) x_j for each int32 of qw [R, C] (R: the slice's int32 rows)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = xs
    row = tl.fma(zero, minus_sum[:, None], base[:, None])  # -(offsets + zero sum x)
    word = _rot16(qw, ASM)
    row = tl.fma(_factor(word, 16, ASM), x0[:, None], row)
    row = tl.fma(_factor(word, 12, ASM), x7[:, None], row)
    word = qw << 8
    row = tl.fma(_factor(word, 12, ASM), x1[:, None], row)
    row = tl.fma(_factor(word, 16, ASM), x2[:, None], row)
    row = tl.fma(_factor(qw, 12, ASM), x3[:, None], row)
    row = tl.fma(_factor(qw, 16, ASM), x4[:, None], row)
    word = qw >> 8
    row = tl.fma(_factor(word, 12, ASM), x5[:, None], row)
    row = tl.fma(_factor(word, 16, ASM), x6[:, None], row)
    return tl.fma(row, scale, acc)


@triton.jit
def _add_slice(acc_a, acc_b, w_a, w_b, x_ptr, k0, k_end, r, EVEN_K: tl.constexpr, ASM: tl.constexpr):
    """The slice at k0 added to both halves' sums [BLOCK_K // 8, BLOCK_N // 2], each int32 row's kept apart."""
    in_k = r < (k_end - k0) // 8 if not EVEN_K else r >= 0
    bf16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    x32 = x_ptr.to(tl.pointer_type(tl.int32))
    offs_x = (k0 + r * 8) // 2
    x0, x1 = _x_pair(x32, offs_x, in_k, 0, bf16)
    x2, x3 = _x_pair(x32, offs_x, in_k, 1, bf16)
    x4, x5 = _x_pair(x32, offs_x, in_k, 2, bf16)
    x6, x7 = _x_pair(x32, offs_x, in_k, 3, bf16)
    at16 = (x0 + x2) + (x4 + x6)  # the x_j of nibbles placed at bit 16 (offset 2^7)
    at12 = (x1 + x3) + (x5 + x7)  # and at bit 12 (offset 2^11)
    base = -(at16 * 128.0 + at12 * 2048.0)
    xs = (x0, x1, x2, x3, x4, x5, x6, x7)
    minus_sum = -(at16 + at12)
    acc_a = _dot8(w_a[0], w_a[1], w_a[2], xs, minus_sum, base, acc_a, ASM)
    acc_b = _dot8(w_b[0], w_b[1], w_b[2], xs, minus_sum, base, acc_b, ASM)
    return acc_a, acc_b


# Program (n tile, split) adds its split's run of BLOCK_K-wide slices of K (each in one group) for
# BLOCK_N outputs, as two [BLOCK_K // 8, BLOCK_N // 2] tiles of sums kept per int32 row until the end:
# two half-width tiles make each thread hold one int32 row of both, so x's preparation is shared.
# Nibble j of an int32 is at bit 4 j: j = 0 and 7 go to bits 16 and 12 (halves swapped), 1 and 2 to
# 12 and 16 (<< 8), 3 and 4 are in place, 5 and 6 go to 12 and 16 (>> 8).
# The first slice's weights are loaded before wait_for_previous: no kernel writes them, and with
# PDL the programs start during the previous kernel, so those loads overlap its tail.
@triton.jit
def _int4_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, N, K, k_per_split,
                      GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, MAX_SPLITS: tl.constexpr,
                      EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, ROW_GROUPS: tl.constexpr, STAGES: tl.constexpr, GATED: tl.constexpr,
                      PDL: tl.constexpr):
    pid_n, split = tl.program_id(0), tl.program_id(1)
    if GATED:  # gate columns (features) BLOCK_N // 2 from pid_n's, their up columns N // 2 further on
        offs_a = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        b_shift = N // 2
        mask_a = offs_a < b_shift
        mask_b = mask_a
    else:
        offs_a = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
        b_shift = BLOCK_N // 2
        mask_a, mask_b = offs_a < N, offs_a + b_shift < N
    offs_b = offs_a + b_shift
    k_start = split * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    r = tl.arange(0, BLOCK_K // 8)
    p_a = qw_ptr + (k_start // 8 + r)[:, None].to(tl.int64) * N + offs_a[None, :]
    p_b = p_a + b_shift
    w_a = _load_slice(p_a, s_ptr, z_ptr, k_start, k_end, r, offs_a, mask_a, N, GROUP, EVEN_K, EVEN_N, ROW_GROUPS)
    w_b = _load_slice(p_b, s_ptr, z_ptr, k_start, k_end, r, offs_b, mask_b, N, GROUP, EVEN_K, EVEN_N, ROW_GROUPS)
    wait_for_previous(PDL)
    zeros = tl.zeros([BLOCK_K // 8, BLOCK_N // 2], dtype=tl.float32)
    acc_a, acc_b = _add_slice(zeros, zeros, w_a, w_b, x_ptr, k_start, k_end, r, EVEN_K, ASM)
    for k0 in tl.range(k_start + BLOCK_K, k_end, BLOCK_K, num_stages=STAGES):
        p_a += (BLOCK_K // 8) * N
        p_b += (BLOCK_K // 8) * N
        w_a = _load_slice(p_a, s_ptr, z_ptr, k0, k_end, r, offs_a, mask_a, N, GROUP, EVEN_K, EVEN_N, ROW_GROUPS)
        w_b = _load_slice(p_b, s_ptr, z_ptr, k0, k_end, r, offs_b, mask_b, N, GROUP, EVEN_K, EVEN_N, ROW_GROUPS)
        acc_a, acc_b = _add_slice(acc_a, acc_b, w_a, w_b, x_ptr, k0, k_end, r, EVEN_K, ASM)
    # the halves' sums side by side, [1, BLOCK_N] in the order a0, b0, a1, b1, ..., with their columns
    total = tl.reshape(tl.join(tl.sum(acc_a, axis=0), tl.sum(acc_b, axis=0)), [1, BLOCK_N])
    offs = tl.reshape(tl.join(offs_a, offs_b), [1, BLOCK_N])
    mask = tl.reshape(tl.join(mask_a, mask_b), [1, BLOCK_N])
    last = True
    if SPLIT:
        total, last = sum_splits(total, part_ptr, count_ptr, pid_n, split, tl.num_programs(1), N, offs, mask,
                                 MAX_SPLITS)
    if last:
        if HAS_BIAS:
            total += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if GATED:  # silu_and_mul's rounding points: gate and up in the model dtype first
            dtype: tl.constexpr = out_ptr.dtype.element_ty
            gate, up = tl.split(tl.reshape(total, [BLOCK_N // 2, 2]))
            act = silu_mul(cast_rtne(gate, dtype).to(tl.float32), cast_rtne(up, dtype).to(tl.float32), dtype)
            tl.store(out_ptr + offs_a, act, mask=mask_a)
        else:
            tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


# From benchmarks/int4_kernel.py's sweep on an H100 (Qwen3-8B's projections and LM head, group 128):
# 64 outputs and 128 of K a program, 4 warps, K split until there are about 8 programs an SM. Their
# loads are not staged through shared memory when K is split (the programs in flight cover the
# latency). With at least WHOLE_K_TILES tiles an SM (gate|up, 384 tiles on 132 SMs) K is not split:
# each program's loop runs long enough for four stages to pay, and no partials make a round trip
# (24576x4096: 23.6 us against 28-32 split 3 ways, the split that fills 8 programs an SM). On an H200 the
# four projections took 51.3 us at group 128 against 56.0 for the next best config, and slices of 256 or 512
# (spanning groups) were slower; at group 32 the 128-wide slices spanning four groups took down and o 13.2 and
# 7.0 us against 26.4 and 11.2 with slices of one group (benchmarks/RESULTS.md, 2026-11-28).
CONFIG = (64, 128, 4, 8)  # (BLOCK_N, BLOCK_K, num_warps, programs an SM)
WHOLE_K_TILES = 2


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              bias: torch.Tensor | None, counts: torch.Tensor | None = None, split_k: int = 0,
              config: tuple[int, int, int, int] | None = None, gated: bool = False,
              stages: int | None = None) -> torch.Tensor:
    """int4_linear_ref for x [1, K] (float16 / bfloat16; int4_linear has checked the shapes) -> [1, N], or
    with gated, silu_and_mul of it -> [1, N // 2] in the same launch (a gate|up projection: gate the first
    half of the outputs, up the second).
    counts: split-K counters for cdiv(N, block_n) tiles; split_k: the K splits (0: none from WHOLE_K_TILES
    tiles an SM, else by the config's programs an SM); config: as CONFIG (None: CONFIG; benchmarks compare others);
    stages: the K loop's software-pipeline stages (None: 4 with K whole, 1 with K split)."""
    block_n, block_k, num_warps, programs_per_sm = config or CONFIG
    if stages is not None and stages < 1:
        raise ValueError(f"int4_gemv's K loop takes 1 or more stages, got {stages}")
    k, n = x.shape[1], qweight.shape[1]
    if gated and n % 2:
        raise ValueError(f"a gated projection has as many up as gate outputs, got {n} outputs")
    if x.data_ptr() % 4:  # the kernel reads x in 32-bit pairs
        x = x.clone()
    out = torch.empty((1, n // 2 if gated else n), dtype=x.dtype, device=x.device)
    # slices wider than G span groups (each int32 row lies in one: G is a multiple of 16); with one group any
    # width does; either way the last slice may be masked. Else a power of two dividing G: one group a slice.
    row_groups = group_size != k and block_k > group_size
    if group_size == k or row_groups:
        block_k = min(block_k, max(8, triton.next_power_of_2(k)))
    else:
        block_k = min(block_k, group_size & -group_size)
    tiles = triton.cdiv(n // 2, block_n // 2) if gated else triton.cdiv(n, block_n)
    k_per_split, splits, part, counts = splitk.plan(tiles, k, block_k, (1, n), out, counts, programs_per_sm, split_k,
                                                    WHOLE_K_TILES)
    # (with gated and splits, the partials span all N columns: part is [splits, 1, N])
    if stages is None:
        stages = 4 if splits == 1 else 1
    _int4_gemv_kernel[(tiles, splits)](
        x, qweight, scales, zeros, bias if bias is not None else scales, out, part, counts, n, k, k_per_split,
        GROUP=0 if group_size == k else group_size, HAS_BIAS=bias is not None, SPLIT=splits > 1,
        MAX_SPLITS=splitk.max_splits(splits), EVEN_K=k % block_k == 0,
        EVEN_N=n % block_n == 0, ASM=x.is_cuda, BLOCK_N=block_n, BLOCK_K=block_k, ROW_GROUPS=row_groups,
        STAGES=stages, GATED=gated,
        num_warps=num_warps, num_stages=stages, **pdl_args(x.device))
    return out
