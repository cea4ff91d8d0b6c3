"""GGUF block-quantized weights kept packed on the device, and linear layers that dequantize as they load
(on a GPU from DEQUANTIZE_ROWS rows of x on: the whole weight at once, for cuBLAS).

Formats Q8_0, Q4_0, Q4_1 (blocks of 32) and Q4_K, Q6_K (super-blocks of 256);
checkpoint/gguf_quants.py documents ggml's block layouts. pack_gguf splits a
weight's raw blocks once into one array per field (W is [N, K]; G = K / 32
blocks, S = K / 256 super-blocks per row):

    Q8_0  qs int8 [N, K]             d float16 [N, G]
    Q4_0  qs uint8 [N, K / 2]        d float16 [N, G]
    Q4_1  qs uint8 [N, K / 2]        d float16 [N, G, 2]: (d, m)
    Q4_K  qs uint8 [N, K / 2]        d float16 [N, S, 2]: (d, dmin)    scales int32 [N, S, 3]
    Q6_K  qs (ql) uint8 [N, K / 2]   qh uint8 [N, K / 4]   scales int8 [N, S, 16]   d float32 [N, S]

Every field keeps the file's bits and its size, with two exceptions made so
that each of the kernels' loads is at least 4 aligned bytes: Q4_K's twelve
bytes of 6-bit scales and mins are regrouped into 3 words (pair r = 0..3 of
sub-blocks 2r, 2r + 1 has its values v0..v3 = scale 2r, min 2r, scale 2r + 1,
min 2r + 1: low 4 bits of v_j at bit 16 (r % 2) + 4 j of word r // 2, top 2
bits at bit 8 r + 2 j of word 2), and Q6_K's d is float32 (2 bytes more per
210). The quantized values themselves are the file's bytes.

The kernels read a row of qs in units of W bytes (W = 8 or 16). The unit at
byte p of the row holds W "low" elements at columns col(p) + t, t < W, and
W "high" ones at col(p) + HI + t: the two nibbles of a byte (Q8_0: bytes
col(p) + t and col(p) + 16 + t). In the 32-blocks, col(p) = 32 (p // 16) +
p % 16 and HI = 16; in Q4_K (a super-block's 128 bytes are 4 runs of 32 whose
low nibbles are sub-block 2r and high ones 2r + 1), col(p) = 256 s + 64 r + l
and HI = 32; in Q6_K, col(p) = 256 s + 128 h + l and HI = 64 (s the
super-block, r, h and l the run, half and position in it).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from headrace.kernels.device import num_sms, pdl_args, wait_for_previous
from headrace.kernels.splitk import counters_for, sum_splits

_Q8_0, _Q4_0, _Q4_1, _Q4_K, _Q6_K = (tl.constexpr(i) for i in range(5))


class _Format(NamedTuple):
    code: int  # the kernels' FMT
    block: int  # elements per block
    size: int  # bytes per block
    hi: int  # the high elements' column offset within a unit (HI above)


FORMATS = {  # the formats with a packed kernel
    "Q8_0": _Format(0, 32, 34, 16), "Q4_0": _Format(1, 32, 18, 16), "Q4_1": _Format(2, 32, 20, 16),
    "Q4_K": _Format(3, 256, 144, 32), "Q6_K": _Format(4, 256, 210, 64),
}


@dataclass(frozen=True)
class PackedGGUF:
    """A weight [N, K] in a GGUF block format, one array per field (layouts in the module docstring)."""
    type_name: str
    shape: tuple[int, int]  # (N, K)
    qs: torch.Tensor  # the quantized values: int8 [N, K] (Q8_0) or uint8 [N, K / 2]
    d: torch.Tensor  # the block scales (with Q4_1's m and Q4_K's dmin)
    scales: torch.Tensor | None = None  # Q4_K: int32 [N, S, 3]; Q6_K: int8 [N, S, 16]
    qh: torch.Tensor | None = None  # Q6_K: uint8 [N, K / 4], the top 2 bits

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qs, self.d, self.scales, self.qh) if t is not None]

    def to(self, device: torch.device | str) -> PackedGGUF:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PackedGGUF(self.type_name, self.shape, move(self.qs), move(self.d), move(self.scales), move(self.qh))


def packed_nbytes(p: PackedGGUF) -> int:
    """Bytes p holds on its device."""
    return sum(t.numel() * t.element_size() for t in p.tensors())


def _k4_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The file's [N, S, 12] scale bytes -> six-bit scales and mins, int32 [N, S, 8] each."""
    p = packed.to(torch.int32)
    a, b, c = p[..., 0:4], p[..., 4:8], p[..., 8:12]
    scales = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], dim=-1)
    mins = torch.cat([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], dim=-1)
    return scales, mins


def _k4_shifts(device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r, j = torch.arange(4, device=device)[:, None], torch.arange(4, device=device)  # pair, value
    return r, 16 * (r % 2) + 4 * j, 8 * r + 2 * j  # [4, 1], [4, 4], [4, 4]


def _k4_regroup(packed: torch.Tensor) -> torch.Tensor:
    """The file's [N, S, 12] scale bytes -> the kernels' int32 [N, S, 3] (module docstring)."""
    sc, mn = _k4_scales_mins(packed)
    v = torch.stack([sc[..., 0::2], mn[..., 0::2], sc[..., 1::2], mn[..., 1::2]], dim=-1).long()  # [N, S, r, j]
    r, lo_at, hi_at = _k4_shifts(packed.device)
    lo = ((v & 15) << lo_at).sum(-1)  # [N, S, 4]: each pair's 16 bits in place
    words = torch.cat([lo[..., 0::2] + lo[..., 1::2], ((v >> 4) << hi_at).sum((-1, -2))[..., None]], dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _k4_ungroup(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 [N, S, 3] -> six-bit scales and mins, int64 [N, S, 8] each."""
    w = words.long() & 0xFFFFFFFF
    r, lo_at, hi_at = _k4_shifts(words.device)
    v = ((w[..., r // 2] >> lo_at) & 15) | (((w[..., 2:3, None] >> hi_at) & 3) << 4)  # [N, S, r, j]
    return v[..., 0::2].flatten(-2), v[..., 1::2].flatten(-2)  # (scale, min) of sub-blocks 2r, 2r + 1


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
    nb = k // fmt.block
    blocks = raw.reshape(n, nb, fmt.size)  # [N, blocks per row, type_size]

    def field(start: int, stop: int, dtype: torch.dtype, *dims: int) -> torch.Tensor:  # -> [N, *dims]
        return blocks[:, :, start:stop].contiguous().view(dtype).reshape(n, *dims)

    if type_name == "Q8_0":
        return PackedGGUF(type_name, (n, k), field(2, 34, torch.int8, k), field(0, 2, torch.float16, nb))
    if type_name == "Q4_0":
        return PackedGGUF(type_name, (n, k), field(2, 18, torch.uint8, k // 2), field(0, 2, torch.float16, nb))
    if type_name == "Q4_1":
        return PackedGGUF(type_name, (n, k), field(4, 20, torch.uint8, k // 2), field(0, 4, torch.float16, nb, 2))
    if type_name == "Q4_K":
        return PackedGGUF(type_name, (n, k), field(16, 144, torch.uint8, k // 2), field(0, 4, torch.float16, nb, 2),
                          scales=_k4_regroup(field(4, 16, torch.uint8, nb, 12)))
    return PackedGGUF(type_name, (n, k), field(0, 128, torch.uint8, k // 2), field(208, 210, torch.float16, nb).float(),
                      scales=field(192, 208, torch.int8, nb, 16), qh=field(128, 192, torch.uint8, k // 4))


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., L] bytes -> [..., 2, L] int32: low nibbles, then high ones."""
    q = qs.to(torch.int32)
    return torch.stack([q & 0x0F, q >> 4], dim=-2)


def dequantize_gguf(p: PackedGGUF, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """-> W [N, K] in dtype, computed in float32 with ggml's operations in ggml's order, then cast."""
    n, k = p.shape
    g, s = k // 32, k // 256
    if p.type_name == "Q8_0":
        w = p.qs.float().reshape(n, g, 32) * p.d.float()[..., None]
    elif p.type_name in ("Q4_0", "Q4_1"):
        q = _nibbles(p.qs.reshape(n, g, 16)).reshape(n, g, 32).float()  # [N, G, 32]
        d = p.d.float() if p.type_name == "Q4_1" else p.d.float()[..., None]  # [N, G, 2] (d, m) or [N, G, 1]
        w = (q - 8.0) * d if p.type_name == "Q4_0" else q * d[..., :1] + d[..., 1:]
    elif p.type_name == "Q4_K":
        sc, mn = _k4_ungroup(p.scales)  # [N, S, 8]
        d = p.d.float()  # [N, S, 2]
        step = (d[..., :1] * sc.float())[..., None]  # [N, S, 8, 1]
        offset = (d[..., 1:] * mn.float())[..., None]  # [N, S, 8, 1]
        q = _nibbles(p.qs.reshape(n, s, 4, 32)).reshape(n, s, 8, 32).float()
        w = q * step - offset
    else:  # Q6_K
        ql = _nibbles(p.qs.reshape(n, s, 2, 64)).reshape(n, s, 2, 4, 32)  # [N, S, half, k, 32]
        shifts = torch.arange(0, 8, 2, dtype=torch.int32, device=p.qs.device)[:, None]  # (no host copy: graphs)
        qh = (p.qh.reshape(n, s, 2, 1, 32).to(torch.int32) >> shifts) & 0x03  # [N, S, half, k, 32]
        q = ((ql | (qh << 4)) - 32).reshape(n, s, 16, 16).float()  # [N, S, 16, 16]
        step = p.d[..., None] * p.scales.float()  # [N, S, 16]
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
def _col(FMT: tl.constexpr, p):
    """Byte p of a row of qs (Q8_0: of its low halves) -> the column of its low element."""
    if FMT == _Q4_K:
        col = 256 * (p // 128) + 64 * ((p % 128) // 32) + p % 32
    elif FMT == _Q6_K:
        col = 256 * (p // 128) + 128 * ((p % 128) // 64) + p % 64
    else:
        col = 32 * (p // 16) + p % 16
    return col


@triton.jit
def _half(w, SHIFT: tl.constexpr):
    """The float16 in bits SHIFT..SHIFT + 15 of int32 w, as float32."""
    return ((w >> SHIFT) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _six_bits(lo_word, top_word, lo_at, top_at):
    """A Q4_K scale or min: 4 bits at lo_at of lo_word, 2 at top_at of top_word."""
    return (((lo_word >> lo_at) & 15) | (((top_word >> top_at) & 3) << 4)).to(tl.float32)


@triton.jit
def _dequant(FMT: tl.constexpr, W: tl.constexpr, EVEN_K: tl.constexpr, qs_ptr, d_ptr, sc_ptr, qh_ptr, n, v, N, K,
             stride_qs, stride_qh, stride_d, stride_sc):
    """Rows n [BN] (int64), units v [NU] of W bytes -> their (low, high) elements, float32 [BN, NU, W]
    each (zeros outside the weight). Scales are decoded once per (row, unit) and broadcast over its
    elements. Row strides come as arguments so that Triton sees which are multiples of 16; with EVEN_K
    (no unit past the row's end) the masks are constant along rows, so short loads are still prefetched."""
    t = tl.arange(0, W)[None, None, :]
    if EVEN_K:
        ok2 = tl.broadcast_to((n < N)[:, None], [n.shape[0], v.shape[0]])  # [BN, NU]
    else:
        ok2 = (n < N)[:, None] & (v < K // (2 * W))[None, :]
    ok = ok2[:, :, None]
    n2, p = n[:, None], (v * W)[None, :]  # p: the unit's first byte in its row of qs
    blk = n2 * stride_d + v[None, :] // (16 // W)  # a 32-block's d (written so Triton sees it contiguous in v)
    if FMT == _Q8_0:
        at = qs_ptr + (n2 * stride_qs + _col(FMT, p))[:, :, None] + t
        d = tl.load(d_ptr + blk, mask=ok2, other=0.0).to(tl.float32)[:, :, None]
        lo = _exact_float(tl.load(at, mask=ok, other=0).to(tl.int32) + 128, 128) * d
        hi = _exact_float(tl.load(at + 16, mask=ok, other=0).to(tl.int32) + 128, 128) * d
    else:
        b = tl.load(qs_ptr + (n2 * stride_qs + p)[:, :, None] + t, mask=ok, other=0).to(tl.int32)
        if FMT == _Q4_0:
            d = tl.load(d_ptr + blk, mask=ok2, other=0.0).to(tl.float32)[:, :, None]
            lo = _exact_float(b & 15, 8) * d
            hi = _exact_float(b >> 4, 8) * d
        elif FMT == _Q4_1:
            dm = tl.load(d_ptr + blk, mask=ok2, other=0)  # (d, m) as one word
            d, m = _half(dm, 0)[:, :, None], _half(dm, 16)[:, :, None]
            lo = _exact_float(b & 15, 0) * d + m
            hi = _exact_float(b >> 4, 0) * d + m
        elif FMT == _Q4_K:
            sup, r = p // 128, (p % 128) // 32  # super-block, run (pair of sub-blocks 2r, 2r + 1)
            dm = tl.load(d_ptr + n2 * stride_d + sup, mask=ok2, other=0)
            at_s = sc_ptr + n2 * stride_sc + 3 * sup
            lo4 = tl.load(at_s + r // 2, mask=ok2, other=0)
            top2 = tl.load(at_s + 2, mask=ok2, other=0)
            sh, th = 16 * (r % 2), 8 * r
            d, dmin = _half(dm, 0), _half(dm, 16)
            lo_step, lo_off = d * _six_bits(lo4, top2, sh, th), dmin * _six_bits(lo4, top2, sh + 4, th + 2)
            hi_step, hi_off = d * _six_bits(lo4, top2, sh + 8, th + 4), dmin * _six_bits(lo4, top2, sh + 12, th + 6)
            lo = _exact_float(b & 15, 0) * lo_step[:, :, None] - lo_off[:, :, None]
            hi = _exact_float(b >> 4, 0) * hi_step[:, :, None] - hi_off[:, :, None]
        else:  # Q6_K
            sup, h, r0 = p // 128, (p % 128) // 64, p % 64  # super-block, half, byte in the half's 64
            qh = tl.load(qh_ptr + (n2 * stride_qh + 64 * sup + 32 * h + r0 % 32)[:, :, None] + t,
                         mask=ok, other=0).to(tl.int32)
            shift = (2 * (r0 // 32))[:, :, None]
            d = tl.load(d_ptr + n2 * stride_d + sup, mask=ok2, other=0.0)
            at_s = sc_ptr + n2 * stride_sc + 4 * sup + 2 * h  # the words of scales 8h..8h+3 and 8h+4..8h+7
            byte = 24 - 8 * (r0 // 16)
            s_lo = ((tl.load(at_s, mask=ok2, other=0) << byte) >> 24).to(tl.float32)
            s_hi = ((tl.load(at_s + 1, mask=ok2, other=0) << byte) >> 24).to(tl.float32)
            lo = _exact_float((b & 15) | (((qh >> shift) & 3) << 4), 32) * (d * s_lo)[:, :, None]
            hi = _exact_float((b >> 4) | (((qh >> (shift + 4)) & 3) << 4), 32) * (d * s_hi)[:, :, None]
    return lo, hi


# Triton, one row of x (decode): program (row tile, K split, x row) streams BN
# weight rows over its run of K, NU units of 8 bytes per step, summing float32
# products per element and reducing once at the end. x is read in the weights'
# register layout (no shuffle through shared memory): with X_ONCE as
# [1, NU, 8], once per thread (when NU is 32 per warp or more, each thread
# holds its units of every row), else as [BN, NU, 8] (a copy per row, from L1).
@triton.jit
def _gguf_gemv_kernel(x_ptr, qs_ptr, d_ptr, sc_ptr, qh_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, N, K,
                      stride_xm, stride_qs,
                      stride_qh, stride_d, stride_sc, tiles_per_split, FMT: tl.constexpr, HI: tl.constexpr,
                      BN: tl.constexpr, NU: tl.constexpr, EVEN_K: tl.constexpr, X_ONCE: tl.constexpr,
                      HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    pid_n, split, row = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    num_rows = tl.num_programs(2)
    n = pid_n * BN + tl.arange(0, BN).to(tl.int64)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K // 16, NU))
    acc = tl.zeros([BN, NU, 8], dtype=tl.float32)
    for tile in range(first, last):
        v = tile * NU + tl.arange(0, NU)
        lo, hi = _dequant(FMT, 8, EVEN_K, qs_ptr, d_ptr, sc_ptr, qh_ptr, n, v, N, K, stride_qs, stride_qh, stride_d,
                          stride_sc)
        at = x_ptr + row * stride_xm + _col(FMT, (8 * v)[None, :, None] + tl.arange(0, 8)[None, None, :])
        in_k = (v < K // 16)[None, :, None]
        shape: tl.constexpr = [1, NU, 8] if X_ONCE else [BN, NU, 8]
        at, in_k = tl.broadcast_to(at, shape), tl.broadcast_to(in_k, shape)
        x_lo = tl.load(at, mask=in_k, other=0.0).to(tl.float32)
        x_hi = tl.load(at + HI, mask=in_k, other=0.0).to(tl.float32)
        acc += lo * x_lo
        acc += hi * x_hi
    y = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BN]
    last = True
    if SPLIT:
        y, last = sum_splits(y, part_ptr, count_ptr, row * tl.num_programs(0) + pid_n, split, tl.num_programs(1),
                             num_rows * N, row * N + n, n < N)
    if last:
        if HAS_BIAS:
            y += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * N + n, y.to(out_ptr.dtype.element_ty), mask=n < N)


# Triton, many rows: program (row tile of x, row tile of W, K split) computes
# y^T's [BN, BM] tile as W_tile @ x_tile^T, so the dequantized weights are the
# dot's first operand (wgmma takes it from registers) and few x rows still fill
# the instruction's N. A step is NU units of 16 bytes: two dots, low and high
# elements. Every load is 4 bytes or more, so Triton can prefetch it stages ahead.
@triton.jit(do_not_specialize=["M"])
def _gguf_mm_kernel(x_ptr, qs_ptr, d_ptr, sc_ptr, qh_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
                    stride_xm, stride_qs,
                    stride_qh, stride_d, stride_sc, tiles_per_split, FMT: tl.constexpr, HI: tl.constexpr,
                    BN: tl.constexpr, BM: tl.constexpr, NU: tl.constexpr, PRECISION: tl.constexpr,
                    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM).to(tl.int64)  # rows of x
    n = pid_n * BN + tl.arange(0, BN).to(tl.int64)
    j = tl.arange(0, NU * 16)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K // 32, NU))
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for tile in range(first, last):
        v = tile * NU + tl.arange(0, NU)
        lo, hi = _dequant(FMT, 16, EVEN_K, qs_ptr, d_ptr, sc_ptr, qh_ptr, n, v, N, K, stride_qs, stride_qh, stride_d,
                          stride_sc)
        lo = tl.reshape(lo, [BN, NU * 16]).to(x_ptr.dtype.element_ty)
        hi = tl.reshape(hi, [BN, NU * 16]).to(x_ptr.dtype.element_ty)
        at = x_ptr + rows[None, :] * stride_xm + _col(FMT, tile * NU * 16 + j)[:, None]  # [NU * 16, BM]
        mask = (tile * NU + j // 16 < K // 32)[:, None] & (rows < M)[None, :]
        acc = tl.dot(lo, tl.load(at, mask=mask, other=0.0), acc, input_precision=PRECISION)
        acc = tl.dot(hi, tl.load(at + HI, mask=mask, other=0.0), acc, input_precision=PRECISION)
    out_at = rows[None, :] * N + n[:, None]  # [BN, BM]
    mask = (rows < M)[None, :] & (n < N)[:, None]
    last = True
    if SPLIT:
        acc, last = sum_splits(acc, part_ptr, count_ptr, pid_m * tl.num_programs(1) + pid_n, split,
                               tl.num_programs(2), M * N, out_at, mask)
    if last:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + out_at, acc.to(out_ptr.dtype.element_ty), mask=mask)


class _Config(NamedTuple):
    gemv: bool  # the CUDA-core kernel, one program per x row (else tl.dot tiles)
    block_n: int  # weight rows per program
    block_m: int  # x rows per program (tl.dot only)
    units: int  # units of qs per step (NU): of 8 bytes in the GEMV, of 16 in the tl.dot kernel
    num_warps: int
    num_stages: int
    split_k: int = 0  # 0: enough K splits to give every SM about two programs
    x_once: bool = True  # GEMV: x read once per thread (see _gguf_gemv_kernel)


# Chosen from a sweep on an H100 (benchmarks/gguf_kernel.py --sweep). One x
# row (decode) is bound by reading the packed weights: the GEMV, narrow row
# tiles, with its layout per format. More rows: tl.dot tiles by the largest M
# of each bucket, small ones with K split so every SM streams, large ones so
# that each dequantized weight tile serves many rows of x.
_DECODE = {
    "Q8_0": _Config(True, 2, 1, 128, 2, 1, 0, False), "Q4_0": _Config(True, 4, 1, 64, 4, 1, 0, False),
    "Q4_1": _Config(True, 4, 1, 64, 4, 1, 0, False), "Q4_K": _Config(True, 2, 1, 128, 2, 1),
    "Q6_K": _Config(True, 2, 1, 128, 2, 1),
}
_CONFIGS = (
    (16, _Config(False, 64, 16, 4, 4, 4)),
    (64, _Config(False, 64, 64, 4, 4, 4)),
    (256, _Config(False, 64, 128, 4, 4, 3, 1)),
    (None, _Config(False, 128, 256, 4, 8, 2, 1)),
)


@functools.cache
def _roomy(device: torch.device) -> bool:
    """Whether a program may take about 227 KB of shared memory (H100, H200, B200), as the large tiles do."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) in ((9, 0), (10, 0))


def _pick_config(m: int, type_name: str, device: torch.device) -> _Config:
    if m <= 1:
        return _DECODE[type_name]
    cfg = next(cfg for limit, cfg in _CONFIGS if limit is None or m <= limit)
    # Elsewhere (99 KB on sm_86/89): tiles that take under 80 KB in every format and dtype.
    return cfg if _roomy(device) else cfg._replace(block_n=64, block_m=min(cfg.block_m, 64), num_warps=4, num_stages=2)


def _fields(p: PackedGGUF) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """(qs, d, scales, qh) as the kernels take them, and (qs, qh, d, scales)'s row strides (p has rows)."""
    # Words the kernels read as int32: Q4_1's and Q4_K's (d, m) pairs, Q4_K's and Q6_K's scales.
    d = p.d.view(torch.int32) if p.d.dim() == 3 else p.d
    sc = p.d if p.scales is None else p.scales.view(torch.int32).reshape(p.shape[0], -1)
    qh = p.qs if p.qh is None else p.qh  # (p.qs, p.d stand in for what a format does not read)
    return (p.qs, d, sc, qh), (p.qs.stride(0), qh.stride(0), d.stride(0), sc.stride(0))


def _launch(x: torch.Tensor, p: PackedGGUF, bias: torch.Tensor | None, cfg: _Config,
            counts: torch.Tensor | None = None) -> torch.Tensor:
    """gguf_linear on a 2-d x [M, K] with the given config (benchmarks compare configs through it)."""
    (m, k), n = x.shape, p.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    fmt = FORMATS[p.type_name]
    width = 8 if cfg.gemv else 16  # bytes of qs per unit
    units = min(cfg.units, triton.next_power_of_2(k // (2 * width)))
    tiles = triton.cdiv(n, cfg.block_n) * (m if cfg.gemv else triton.cdiv(m, cfg.block_m))
    k_tiles = triton.cdiv(k // (2 * width), units)
    split_k = cfg.split_k or triton.cdiv(2 * num_sms(x.device), tiles)
    tiles_per_split = triton.cdiv(k_tiles, min(split_k, k_tiles))
    split_k = triton.cdiv(k_tiles, tiles_per_split)
    part = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    counts = out if split_k == 1 else counters_for(counts, tiles, x.device)
    fields, field_strides = _fields(p)
    args = (x, *fields, p.d if bias is None else bias, out, part, counts)
    strides = (x.stride(0), *field_strides, tiles_per_split)
    common = dict(FMT=fmt.code, HI=fmt.hi, BN=cfg.block_n, NU=units, EVEN_K=k // (2 * width) % units == 0,
                  HAS_BIAS=bias is not None, SPLIT=split_k > 1, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages, **pdl_args(x.device))
    if cfg.gemv:
        _gguf_gemv_kernel[(triton.cdiv(n, cfg.block_n), split_k, m)](*args, n, k, *strides, X_ONCE=cfg.x_once,
                                                                     **common)
    else:
        grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split_k)
        _gguf_mm_kernel[grid](*args, m, n, k, *strides, BM=cfg.block_m,
                              PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **common)
    return out


def split_k_tiles(n: int) -> int:
    """The most output tiles a split-K launch of gguf_linear on N rows of W has (its counters,
    kernels/splitk.py): the decode GEMV's narrowest row tiles, for its one row of x."""
    return triton.cdiv(n, min(cfg.block_n for cfg in _DECODE.values()))


# Triton, for many rows: program (row tile, K tile) writes W's [BN, NU * 32]
# elements in the activation dtype, decoded by _dequant as the mm kernel's are,
# each unit's low and high elements at their columns; cuBLAS multiplies. FP
# fusion is off at launch so that Q4_1's q * d + m and Q4_K's q * step - offset
# round twice, as dequantize_gguf does, rather than once in an FMA.
@triton.jit
def _dequantize_kernel(qs_ptr, d_ptr, sc_ptr, qh_ptr, w_ptr, N, K, stride_qs, stride_qh, stride_d, stride_sc,
                       FMT: tl.constexpr, HI: tl.constexpr, BN: tl.constexpr, NU: tl.constexpr,
                       EVEN_K: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN).to(tl.int64)
    v = tl.program_id(1) * NU + tl.arange(0, NU)
    lo, hi = _dequant(FMT, 16, EVEN_K, qs_ptr, d_ptr, sc_ptr, qh_ptr, n, v, N, K, stride_qs, stride_qh, stride_d,
                      stride_sc)
    at = w_ptr + (n[:, None] * K + _col(FMT, 16 * v)[None, :])[:, :, None] + tl.arange(0, 16)[None, None, :]
    mask = ((n < N)[:, None] & (v < K // 32)[None, :])[:, :, None]  # [BN, NU, 1]
    tl.store(at, lo.to(w_ptr.dtype.element_ty), mask=mask)
    tl.store(at + HI, hi.to(w_ptr.dtype.element_ty), mask=mask)


# From this many rows of x on a GPU, gguf_linear dequantizes W once and
# multiplies with cuBLAS instead of running the mm kernel. On an H100
# (benchmarks/gguf_kernel.py, 4096x4096 and 12288x4096, every format) that
# took 1.9-4.6x the bf16 GEMM's time at 256 rows against the mm kernel's
# 2.8-10x, and 1.1-1.6x at 2048 rows against 2.5-6.4x. Below 256 rows it was
# not measured.
DEQUANTIZE_ROWS = 256


def dequantize_gguf_triton(p: PackedGGUF, dtype: torch.dtype) -> torch.Tensor:
    """dequantize_gguf(p, dtype)'s W [N, K] (the same values), in one launch on p's device."""
    n, k = p.shape
    w = torch.empty((n, k), dtype=dtype, device=p.qs.device)
    if n == 0 or k == 0:
        return w
    fmt = FORMATS[p.type_name]
    block_n, units = 32, 8  # a program's rows and units of 16 bytes (256 columns)
    fields, strides = _fields(p)
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k // 32, units))](
        *fields, w, n, k, *strides, FMT=fmt.code, HI=fmt.hi, BN=block_n, NU=units, EVEN_K=k // 32 % units == 0,
        num_warps=4, enable_fp_fusion=False)
    return w


def gguf_linear(x: torch.Tensor, p: PackedGGUF, bias: torch.Tensor | None,
                counts: torch.Tensor | None = None) -> torch.Tensor:
    """gguf_linear_ref's result in one launch: x [..., K] -> [..., N]. From DEQUANTIZE_ROWS rows
    on a GPU, W is dequantized by a Triton kernel, then F.linear (cuBLAS). counts: the layer's
    split-K counters (split_k_tiles(N) of them, zero between calls).

    The launches depend only on shapes (no host syncs, no autotuning), so they
    can be captured in a CUDA graph; results do not depend on the run.
    """
    _check_input(x, p, bias)
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or x.stride(-1) != 1:
        raise ValueError(f"x must be float16, bfloat16 or float32, contiguous in its last dimension; got {x.dtype} "
                         f"with strides {x.stride()}")
    if p.qs.device != x.device:
        raise ValueError(f"the weight is on {p.qs.device} and x on {x.device}")
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if x.is_cuda and x2.shape[0] >= DEQUANTIZE_ROWS:
        out = F.linear(x2, dequantize_gguf_triton(p, x.dtype), bias)
    else:
        out = _launch(x2, p, bias, _pick_config(x2.shape[0], p.type_name, x.device), counts)
    return out.reshape(*x.shape[:-1], p.shape[0])
