"""GGUF block-quantized weights kept packed on the device, and linear layers that dequantize as they load.

Formats Q8_0, Q4_0, Q4_1 (blocks of 32) and Q4_K, Q6_K (super-blocks of 256);
checkpoint/gguf_quants.py documents ggml's block layouts. pack_gguf splits a
weight's raw blocks once into one array per field, with the file's bits and
bytes (W is [N, K]; G = K / 32 groups, S = K / 256 super-blocks per row):

    Q8_0  qs int8 [N, K]                   d float16 [N, G]
    Q4_0  qs uint8 [N, K / 2]              d float16 [N, G]
    Q4_1  qs uint8 [N, K / 2]              d, m float16 [N, G]
    Q4_K  qs uint8 [N, K / 2]              scales uint8 [N, 12 S]   d, m (dmin) float16 [N, S]
    Q6_K  qs (ql) uint8 [N, K / 2]         qh uint8 [N, K / 4]      scales int8 [N, K / 16]   d float16 [N, S]

The kernels see every format as G groups per row: group g holds 16 "low"
elements at columns base(g) + t and 16 "high" ones at base(g) + HI + t
(t = 0..15), read from bytes 16 g + t of qs (Q8_0: bytes 32 g + t and
32 g + 16 + t). In the 32-blocks, base = 32 g and HI = 16 (a byte's low and
high nibble); in Q4_K, base = 64 (i // 2) + 16 (i % 2) and HI = 32; in Q6_K,
base = 128 (i // 4) + 16 (i % 4) and HI = 64 (plus 256 s, for g = 8 s + i).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from headrace.kernels.device import num_sms

_Q8_0, _Q4_0, _Q4_1, _Q4_K, _Q6_K = (tl.constexpr(i) for i in range(5))


class _Format(NamedTuple):
    code: int  # the kernels' FMT
    block: int  # elements per block
    size: int  # bytes per block
    hi: int  # the high half's column offset within a group (HI above)


FORMATS = {
    "Q8_0": _Format(0, 32, 34, 16), "Q4_0": _Format(1, 32, 18, 16), "Q4_1": _Format(2, 32, 20, 16),
    "Q4_K": _Format(3, 256, 144, 32), "Q6_K": _Format(4, 256, 210, 64),
}


@dataclass(frozen=True)
class PackedGGUF:
    """A weight [N, K] in a GGUF block format, one array per field (layouts in the module docstring)."""
    type_name: str
    shape: tuple[int, int]  # (N, K)
    qs: torch.Tensor  # quantized values: int8 [N, K] (Q8_0) or uint8 [N, K / 2]
    d: torch.Tensor  # float16 [N, G] or [N, S]: the block scales
    m: torch.Tensor | None = None  # float16: Q4_1's m [N, G], Q4_K's dmin [N, S]
    scales: torch.Tensor | None = None  # Q4_K: uint8 [N, 12 S]; Q6_K: int8 [N, K / 16]
    qh: torch.Tensor | None = None  # Q6_K: uint8 [N, K / 4], the top 2 bits

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qs, self.d, self.m, self.scales, self.qh) if t is not None]

    def to(self, device: torch.device | str) -> PackedGGUF:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PackedGGUF(self.type_name, self.shape, move(self.qs), move(self.d), move(self.m),
                          move(self.scales), move(self.qh))


def packed_nbytes(p: PackedGGUF) -> int:
    """Bytes p holds on its device (the file's bytes for the same tensor)."""
    return sum(t.numel() * t.element_size() for t in p.tensors())


def pack_gguf(type_name: str, raw: torch.Tensor, shape: tuple[int, int]) -> PackedGGUF:
    """raw uint8 [N, K / block * type_size], a weight's blocks as in the file -> PackedGGUF."""
    fmt = FORMATS.get(type_name)
    if fmt is None:
        raise ValueError(f"GGUF type {type_name!r} has no packed kernel; supported: {', '.join(FORMATS)}")
    if len(shape) != 2 or min(shape) < 0:
        raise ValueError(f"{type_name} weight shape must be (N, K) with N, K >= 0, got {tuple(shape)}")
    n, k = int(shape[0]), int(shape[1])
    if k % fmt.block:
        raise ValueError(f"{type_name} needs K (the row length) a multiple of {fmt.block}, got K = {k}")
    row_bytes = k // fmt.block * fmt.size
    if raw.dtype != torch.uint8 or raw.numel() != n * row_bytes:
        raise ValueError(f"{type_name} weight of shape ({n}, {k}) needs {n} x {row_bytes} uint8 bytes, "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    blocks = raw.reshape(n, k // fmt.block, fmt.size)  # [N, blocks per row, type_size]

    def field(start: int, stop: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        per_row = k // fmt.block * (stop - start) // dtype.itemsize
        return blocks[:, :, start:stop].contiguous().view(dtype).reshape(n, per_row)

    if type_name == "Q8_0":
        return PackedGGUF(type_name, (n, k), field(2, 34, torch.int8), field(0, 2, torch.float16))
    if type_name == "Q4_0":
        return PackedGGUF(type_name, (n, k), field(2, 18), field(0, 2, torch.float16))
    if type_name == "Q4_1":
        return PackedGGUF(type_name, (n, k), field(4, 20), field(0, 2, torch.float16), field(2, 4, torch.float16))
    if type_name == "Q4_K":
        return PackedGGUF(type_name, (n, k), field(16, 144), field(0, 2, torch.float16),
                          field(2, 4, torch.float16), scales=field(4, 16))
    return PackedGGUF(type_name, (n, k), field(0, 128), field(208, 210, torch.float16),
                      scales=field(192, 208, torch.int8), qh=field(128, 192))


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., L] bytes -> [..., 2, L] int32: low nibbles, then high ones."""
    q = qs.to(torch.int32)
    return torch.stack([q & 0x0F, q >> 4], dim=-2)


def _k4_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, S, 12] bytes -> six-bit scales and mins, int32 [N, S, 8] each."""
    p = packed.to(torch.int32)
    a, b, c = p[..., 0:4], p[..., 4:8], p[..., 8:12]
    scales = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], dim=-1)
    mins = torch.cat([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], dim=-1)
    return scales, mins


def dequantize_gguf(p: PackedGGUF, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """-> W [N, K] in dtype, computed in float32 with ggml's operations in ggml's order, then cast."""
    n, k = p.shape
    g, s = k // 32, k // 256
    d = p.d.float()[..., None]  # [N, blocks, 1]
    if p.type_name == "Q8_0":
        w = p.qs.float().reshape(n, g, 32) * d
    elif p.type_name in ("Q4_0", "Q4_1"):
        q = _nibbles(p.qs.reshape(n, g, 16)).reshape(n, g, 32).float()  # [N, G, 32]
        w = (q - 8.0) * d if p.type_name == "Q4_0" else q * d + p.m.float()[..., None]
    elif p.type_name == "Q4_K":
        sc, mn = _k4_scales_mins(p.scales.reshape(n, s, 12))  # [N, S, 8]
        step = (d * sc.float())[..., None]  # [N, S, 8, 1]
        offset = (p.m.float()[..., None] * mn.float())[..., None]  # [N, S, 8, 1]
        q = _nibbles(p.qs.reshape(n, s, 4, 32)).reshape(n, s, 8, 32).float()
        w = q * step - offset
    else:  # Q6_K
        ql = _nibbles(p.qs.reshape(n, s, 2, 64)).reshape(n, s, 2, 4, 32)  # [N, S, half, k, 32]
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=p.qs.device)[:, None]
        qh = (p.qh.reshape(n, s, 2, 1, 32).to(torch.int32) >> shifts) & 0x03  # [N, S, half, k, 32]
        q = ((ql | (qh << 4)) - 32).reshape(n, s, 16, 16).float()  # [N, S, 16, 16]
        step = d * p.scales.reshape(n, s, 16).float()  # [N, S, 16]
        w = q * step[..., None]
    return w.reshape(n, k).to(dtype)


def _check_input(x: torch.Tensor, p: PackedGGUF, bias: torch.Tensor | None) -> None:
    n, k = p.shape
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x must be [..., K] with K = {k} ({p.type_name} weight of shape {p.shape}), "
                         f"got {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [N] = [{n}], got {tuple(bias.shape)}")


def gguf_linear_ref(
    x: torch.Tensor,  # [..., K] float16 / bfloat16 / float32
    p: PackedGGUF,  # weight [N, K]
    bias: torch.Tensor | None,  # [N] in x's dtype
) -> torch.Tensor:
    _check_input(x, p, bias)
    return F.linear(x, dequantize_gguf(p, x.dtype), bias)


@triton.jit
def _exact_float(v, OFFSET: tl.constexpr):
    """v - OFFSET in float32 for int32 v in [0, 2^23): (v | 0x4B000000) read as a float is 2^23 + v exactly,
    one integer and one float instruction where a conversion instruction would run at a fraction of the rate."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)


@triton.jit
def _group_base(FMT: tl.constexpr, g):
    """Group g -> the column of its first low element."""
    if FMT == _Q4_K:
        base = 256 * (g // 8) + 64 * ((g % 8) // 2) + 16 * (g % 2)
    elif FMT == _Q6_K:
        base = 256 * (g // 8) + 128 * ((g % 8) // 4) + 16 * (g % 4)
    else:
        base = 32 * g
    return base


@triton.jit
def _k4_scale_min(sc_ptr, row, sub, mask):
    """Q4_K's six-bit scale and min of sub-block sub (0..7), row -> the super-block's first scale byte."""
    lo4 = sub < 4
    a = tl.load(sc_ptr + row + sub % 4, mask=mask, other=0).to(tl.int32)
    b = tl.load(sc_ptr + row + 4 + sub % 4, mask=mask, other=0).to(tl.int32)
    c = tl.load(sc_ptr + row + 8 + sub % 4, mask=mask, other=0).to(tl.int32)
    sc = tl.where(lo4, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(lo4, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _dequant_groups(FMT: tl.constexpr, qs_ptr, d_ptr, m_ptr, sc_ptr, qh_ptr, n, g, N, K, stride_qs, stride_qh):
    """Rows n [BN] (int64), groups g [NB] -> their (low, high) elements, float32 [BN, NB, 16] each
    (zeros outside the weight). Scales and mins are decoded per (row, group), then broadcast. The row
    strides of qs and qh come as arguments so that Triton sees them divisible by 16 (16-byte loads)."""
    t = tl.arange(0, 16)[None, None, :]
    ok2 = (n < N)[:, None] & (g < K // 32)[None, :]  # [BN, NB]
    ok = ok2[:, :, None]
    n2, g2 = n[:, None], g[None, :]
    if FMT == _Q8_0:
        at = qs_ptr + (n2 * stride_qs + 32 * g2)[:, :, None] + t
        d = tl.load(d_ptr + n2 * (K // 32) + g2, mask=ok2, other=0.0).to(tl.float32)[:, :, None]
        lo = _exact_float(tl.load(at, mask=ok, other=0).to(tl.int32) + 128, 128) * d
        hi = _exact_float(tl.load(at + 16, mask=ok, other=0).to(tl.int32) + 128, 128) * d
    else:
        b = tl.load(qs_ptr + (n2 * stride_qs + 16 * g2)[:, :, None] + t, mask=ok, other=0).to(tl.int32)
        if FMT == _Q4_0 or FMT == _Q4_1:
            blk = n2 * (K // 32) + g2
            d = tl.load(d_ptr + blk, mask=ok2, other=0.0).to(tl.float32)[:, :, None]
            if FMT == _Q4_0:
                lo = _exact_float(b & 15, 8) * d
                hi = _exact_float(b >> 4, 8) * d
            else:
                m = tl.load(m_ptr + blk, mask=ok2, other=0.0).to(tl.float32)[:, :, None]
                lo = _exact_float(b & 15, 0) * d + m
                hi = _exact_float(b >> 4, 0) * d + m
        else:
            sup = n2 * (K // 256) + g2 // 8  # [BN, NB]: the super-block
            i = g2 % 8
            d = tl.load(d_ptr + sup, mask=ok2, other=0.0).to(tl.float32)
            if FMT == _Q4_K:
                dmin = tl.load(m_ptr + sup, mask=ok2, other=0.0).to(tl.float32)
                sc_lo, mn_lo = _k4_scale_min(sc_ptr, 12 * sup, 2 * (i // 2), ok2)
                sc_hi, mn_hi = _k4_scale_min(sc_ptr, 12 * sup, 2 * (i // 2) + 1, ok2)
                lo = _exact_float(b & 15, 0) * (d * sc_lo)[:, :, None] - (dmin * mn_lo)[:, :, None]
                hi = _exact_float(b >> 4, 0) * (d * sc_hi)[:, :, None] - (dmin * mn_hi)[:, :, None]
            else:  # Q6_K
                half = i // 4
                at_h = qh_ptr + (n2 * stride_qh + 64 * (g2 // 8) + 32 * half + 16 * (i % 2))[:, :, None] + t
                qh = tl.load(at_h, mask=ok, other=0).to(tl.int32)
                shift = (2 * ((i % 4) // 2))[:, :, None]
                at_s = sc_ptr + 16 * sup + 8 * half + i % 4
                s_lo = tl.load(at_s, mask=ok2, other=0).to(tl.float32)
                s_hi = tl.load(at_s + 4, mask=ok2, other=0).to(tl.float32)
                lo = _exact_float((b & 15) | (((qh >> shift) & 3) << 4), 32) * (d * s_lo)[:, :, None]
                hi = _exact_float((b >> 4) | (((qh >> (shift + 4)) & 3) << 4), 32) * (d * s_hi)[:, :, None]
    return lo, hi


# Triton, few rows (decode): program (row tile, K split, x row) streams BN
# weight rows over its run of K, NB groups (32 NB columns) per step, with
# float32 products summed per element and reduced once at the end.
@triton.jit
def _gguf_gemv_kernel(x_ptr, qs_ptr, d_ptr, m_ptr, sc_ptr, qh_ptr, bias_ptr, out_ptr, N, K, stride_xm,
                      stride_qs, stride_qh, tiles_per_split, FMT: tl.constexpr, HI: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
                      HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    pid_n, split, row = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    num_rows = tl.num_programs(2)
    n = pid_n * BN + tl.arange(0, BN).to(tl.int64)
    t = tl.arange(0, 16)[None, :]
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K // 32, NB))
    acc = tl.zeros([BN, NB, 16], dtype=tl.float32)
    for tile in range(first, last):
        g = tile * NB + tl.arange(0, NB)
        lo, hi = _dequant_groups(FMT, qs_ptr, d_ptr, m_ptr, sc_ptr, qh_ptr, n, g, N, K, stride_qs, stride_qh)
        at = x_ptr + row * stride_xm + _group_base(FMT, g)[:, None] + t  # [NB, 16]
        in_k = (g < K // 32)[:, None]
        x_lo = tl.load(at, mask=in_k, other=0.0).to(tl.float32)
        x_hi = tl.load(at + HI, mask=in_k, other=0.0).to(tl.float32)
        acc += lo * x_lo[None, :, :] + hi * x_hi[None, :, :]
    y = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BN]
    if SPLIT:
        tl.store(out_ptr + (split * num_rows + row) * N + n, y, mask=n < N)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * N + n, y.to(out_ptr.dtype.element_ty), mask=n < N)


# Triton, many rows: program (row tile of x, row tile of W, K split) computes
# y^T's [BN, BM] tile as W_tile @ x_tile^T, so the dequantized weights are the
# dot's first operand (wgmma can take it from registers) and few x rows still
# fill the instruction's N. Each step is two dots: low and high halves.
@triton.jit(do_not_specialize=["M"])
def _gguf_mm_kernel(x_ptr, qs_ptr, d_ptr, m_ptr, sc_ptr, qh_ptr, bias_ptr, out_ptr, M, N, K, stride_xm,
                    stride_qs, stride_qh, tiles_per_split, FMT: tl.constexpr, HI: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                    NB: tl.constexpr, PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM).to(tl.int64)  # rows of x
    n = pid_n * BN + tl.arange(0, BN).to(tl.int64)
    j = tl.arange(0, NB * 16)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K // 32, NB))
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for tile in range(first, last):
        g = tile * NB + tl.arange(0, NB)
        lo, hi = _dequant_groups(FMT, qs_ptr, d_ptr, m_ptr, sc_ptr, qh_ptr, n, g, N, K, stride_qs, stride_qh)
        lo = tl.reshape(lo, [BN, NB * 16]).to(x_ptr.dtype.element_ty)
        hi = tl.reshape(hi, [BN, NB * 16]).to(x_ptr.dtype.element_ty)
        gj = tile * NB + j // 16
        at = x_ptr + rows[None, :] * stride_xm + (_group_base(FMT, gj) + j % 16)[:, None]  # [NB * 16, BM]
        mask = (gj < K // 32)[:, None] & (rows < M)[None, :]
        acc = tl.dot(lo, tl.load(at, mask=mask, other=0.0), acc, input_precision=PRECISION)
        acc = tl.dot(hi, tl.load(at + HI, mask=mask, other=0.0), acc, input_precision=PRECISION)
    out_at = rows[None, :] * N + n[:, None]  # [BN, BM]
    mask = (rows < M)[None, :] & (n < N)[:, None]
    if SPLIT:
        tl.store(out_ptr + split * M * N + out_at, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + out_at, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["numel"])
def _sum_splits_kernel(part_ptr, bias_ptr, out_ptr, numel, N, num_splits, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """out = bias + the float32 partials [num_splits, M, N], added in split order (reproducible)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in range(1, num_splits):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


class _Config(NamedTuple):
    gemv: bool  # the CUDA-core kernel, one program per x row (else tl.dot tiles)
    block_n: int  # weight rows per program
    block_m: int  # x rows per program (tl.dot only)
    groups: int  # 32-column groups per step (NB)
    num_warps: int
    num_stages: int
    split_k: int = 0  # 0: enough K splits to give every SM about two programs


# By the largest M of each bucket. Decode is bound by reading the packed
# weights: narrow row tiles (and K splits where N is small) so every SM
# streams. Prefill is bound by the tensor cores and by dequantizing: large
# tiles, so each dequantized weight tile serves many rows of x.
_CONFIGS = (
    (1, _Config(True, 4, 1, 32, 4, 1)),
    (16, _Config(False, 64, 16, 8, 4, 3)),
    (64, _Config(False, 64, 64, 4, 4, 3)),
    (256, _Config(False, 128, 64, 2, 4, 3, 1)),
    (None, _Config(False, 128, 128, 2, 8, 3, 1)),
)


def _pick_config(m: int) -> _Config:
    return next(cfg for limit, cfg in _CONFIGS if limit is None or m <= limit)


def _launch(x: torch.Tensor, p: PackedGGUF, bias: torch.Tensor | None, cfg: _Config) -> torch.Tensor:
    """gguf_linear on a 2-d x [M, K] with the given config (benchmarks compare configs through it)."""
    (m, k), n = x.shape, p.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    fmt = FORMATS[p.type_name]
    groups = min(cfg.groups, triton.next_power_of_2(k // 32))
    tiles = triton.cdiv(n, cfg.block_n) * (m if cfg.gemv else triton.cdiv(m, cfg.block_m))
    k_tiles = triton.cdiv(k // 32, groups)
    split_k = cfg.split_k or triton.cdiv(2 * num_sms(x.device), tiles)
    tiles_per_split = triton.cdiv(k_tiles, min(split_k, k_tiles))
    split_k = triton.cdiv(k_tiles, tiles_per_split)
    part = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    dummy = p.d  # stands in for the pointers a format does not read
    args = (x, p.qs, p.d, dummy if p.m is None else p.m, dummy if p.scales is None else p.scales,
            dummy if p.qh is None else p.qh, dummy if bias is None else bias, part)
    strides = (p.qs.stride(0), 16 if p.qh is None else p.qh.stride(0))
    common = dict(FMT=fmt.code, HI=fmt.hi, NB=groups, HAS_BIAS=bias is not None, SPLIT=split_k > 1,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.gemv:
        grid = (triton.cdiv(n, cfg.block_n), split_k, m)
        _gguf_gemv_kernel[grid](*args, n, k, x.stride(0), *strides, tiles_per_split, BN=cfg.block_n,
                                **common)
    else:
        grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split_k)
        _gguf_mm_kernel[grid](*args, m, n, k, x.stride(0), *strides, tiles_per_split, BN=cfg.block_n, BM=cfg.block_m,
                              PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **common)
    if split_k > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](part, args[6], out, m * n, n, split_k,
                                                         HAS_BIAS=bias is not None, BLOCK=block)
    return out


def gguf_linear(x: torch.Tensor, p: PackedGGUF, bias: torch.Tensor | None) -> torch.Tensor:
    """gguf_linear_ref's result in one launch (two where K is split): x [..., K] -> [..., N].

    The launch depends only on shapes (no host syncs, no autotuning), so it
    can be captured in a CUDA graph; results do not depend on the run.
    """
    _check_input(x, p, bias)
    if x.stride(-1) != 1:
        raise ValueError("x must be contiguous in its last dimension")
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    out = _launch(x2, p, bias, _pick_config(x2.shape[0]))
    return out.reshape(*x.shape[:-1], p.shape[0])
