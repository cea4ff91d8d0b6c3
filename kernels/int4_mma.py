"""2 to 8 rows of a w4a16 linear layer on tensor cores (Gluon, mma.sync): y = x W^T, or SiLU-and-mul of gate|up.

kernels/int4.py's layout and reference. Its tl.dot kernel pads a few rows to 16 and stages each dequantized
tile through shared memory; here each weight goes from its int32 to an `mma.sync.m16n8k16` operand in registers:
one `lop3` makes two 4-bit weights into two bfloat16 (or float16) `128 + q` (`1024 + q`), one packed subtract
takes their zero off (exact: small integers), and the rows, padded to the MMA's 8 columns, are the B operand. On
an H200 (benchmarks/RESULTS.md, 2026-11-28) that is 1.2-1.6x faster than the tl.dot kernel at 2 to 8 rows of
Qwen3-8B's projections; at one row it is no faster than kernels/int4_gemv.py, and at 12 and 16 rows slower than
tl.dot, so int4.mma_rows sends it 2 to 8.

K order inside an MMA. The A fragment of `m16n8k16` gives thread (g, c) of a warp rows g and g + 8 at four K
positions, {2c, 2c + 1, 2c + 8, 2c + 9}, and the B fragment the same positions of its column g. Any order of
K works if A and B agree, so each thread reads whole int32s (eight weights of one row) and its 128 K of a step
are the words c, c + 4, c + 8, c + 12 of the step's 16: the MMA's k position 32u + 16t + 8h + 2c + j holds
weight 32u + 8c + 4j + 2t + h (nibble 2t + h + 4j of word 4u + c). Pair (j = 0, 1) is what one lop3 of the
word shifted by 4 (2t + h) gives (mask 0x000F000F), and the rows' x are read in 16-byte runs and put in the
same order in registers: no shared memory (tests/test_kernel_compile.py holds the compiled kernel to that).

Program (tile, split): 64 R weight columns (gated: 32 R gate columns and their up columns N / 2 further on, the
rows g and g + 8 of each warp's MMA tiles the gate and up of one feature) over a run of K in steps of 128; the
next step's words are read before this step's arithmetic, the first step's (and its zeros and scales) before
the PDL wait. The scales multiply each step's sums (a step lies in one group). K split: each program stores its
float32 partial and the last of a tile's splits adds them in split order (as kernels/splitk.py does).

Gluon does not run under TRITON_INTERPRET: the CPU suite compiles this kernel for sm_90, and the GPU suite
checks it against int4_linear_ref.
"""
from __future__ import annotations

import functools

import torch

from headrace.kernels import splitk
from headrace.kernels.device import pdl_args
from headrace.kernels.int4_gemv import WHOLE_K_TILES  # with this many tiles an SM, K is not split

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # pragma: no cover - a Triton without Gluon: int4_gemv serves
    gluon = None

STEP = 128  # K a step: 16 int32s a weight column
# (R: MMA row tiles a warp, so 64 R weight columns a program; programs an SM), plain and gated: timed on an
# H200 at 1-16 rows of Qwen3-8B's projections (benchmarks/RESULTS.md, 2026-11-28)
CONFIGS = {False: (1, 8), True: (2, 8)}
ROWS = 8  # the MMA's B width (rows padded to it): the most rows a call takes

if gluon is not None:
    _cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

    # lop3 0xEA: (a & b) | c. Nibbles at bits 0..3 and 16..19 into the mantissas of 128.0 (bf16) or 1024.0 (f16)
    # pairs, then the pair (128 + zero) taken off.
    _PAIR_BF16 = gl.constexpr("{ .reg .b32 t; lop3.b32 t, $1, 0x000F000F, 0x43004300, 0xEA; sub.rn.bf16x2 $0, t, $2; }")
    _PAIR_F16 = gl.constexpr("{ .reg .b32 t; lop3.b32 t, $1, 0x000F000F, 0x64006400, 0xEA; sub.rn.f16x2 $0, t, $2; }")

    @gluon.jit
    def _wait_for_previous(PDL: gl.constexpr):
        """kernels/device.py's wait_for_previous, for Gluon."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def _pairs(w3, z3, SHIFT: gl.constexpr, FP16: gl.constexpr):
        """int32 [.., 4, 4] words -> their nibbles SHIFT / 4 and SHIFT / 4 + 4 less the zero, as packed pairs."""
        asm: gl.constexpr = _PAIR_F16 if FP16 else _PAIR_BF16
        return gl.inline_asm_elementwise(asm, "=r,r,r", [w3 >> SHIFT, z3], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _weights(words, zq, dtype: gl.constexpr, a_layout: gl.constexpr, BM: gl.constexpr):
        """words int32 [BM, 16] (row m, word 4u + c of the step), zq int32 [BM, 16] (the row's packed 128 + zero)
        -> A [BM, 128] in dtype: (m, 32u + 16t + 8h + 2c + j) = nibble 2t + h + 4j of word 4u + c, less zero."""
        w3 = gl.reshape(words, [BM, 4, 4])
        z3 = gl.reshape(zq, [BM, 4, 4])
        fp16: gl.constexpr = dtype == gl.float16
        t0 = gl.join(_pairs(w3, z3, 0, fp16), _pairs(w3, z3, 4, fp16))  # [BM, u, c, h]
        t1 = gl.join(_pairs(w3, z3, 8, fp16), _pairs(w3, z3, 12, fp16))
        p = gl.join(t0, t1)  # [BM, u, c, h, t]
        lo = p.to(gl.int16).to(dtype, bitcast=True)
        hi = (p >> 16).to(gl.int16).to(dtype, bitcast=True)
        a = gl.permute(gl.join(lo, hi), (0, 1, 4, 3, 2, 5))  # [BM, u, t, h, c, j]
        return gl.convert_layout(gl.reshape(a, [BM, 128]), a_layout)

    @gluon.jit
    def _rows(x_ptr, x_at, x_mask, k0, b_layout: gl.constexpr):
        """The rows' step at k0 as B [128, 8]: (32u + 16t + 8h + 2c + j, r) = x[r, k0 + 32u + 8c + 4j + 2t + h]."""
        x = gl.load(x_ptr + k0 + x_at, mask=x_mask, other=0.0)  # [8 rows, 128]: runs of 8 of K a thread
        x = gl.permute(gl.reshape(x, [8, 4, 4, 2, 2, 2]), (1, 4, 5, 2, 3, 0))  # [u, t, h, c, j, r]
        return gl.convert_layout(gl.reshape(x, [128, 8]), b_layout)

    @gluon.jit
    def _zero_pairs(z_ptr, at, dtype: gl.constexpr):
        """The zeros at `at` as int32 pairs of 128 + zero (1024 + zero in float16), packed as the MMA reads them."""
        magic: gl.constexpr = 1024.0 if dtype == gl.float16 else 128.0
        z = (gl.load(z_ptr + at).to(gl.float32) + magic).to(dtype)
        bits = z.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        return bits | (bits << 16)

    @gluon.jit
    def _sum_splits(total, part_ptr, count_ptr, tile, split, num_splits, stride, offs, mask,
                    MAX_SPLITS: gl.constexpr):
        """kernels/splitk.py's sum_splits, for Gluon."""
        gl.store(part_ptr + split * stride + offs, total, mask=mask)
        _cta_barrier()  # every thread's partial stored before the count says so
        last = gl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == num_splits - 1
        if last:
            total = gl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
            if MAX_SPLITS:
                for s in gl.static_range(1, MAX_SPLITS):
                    src = gl.minimum(num_splits - 1, s)
                    more = gl.load(part_ptr + src * stride + offs, mask=mask, other=0.0, cache_modifier=".cg")
                    total += gl.where(src == s, more, 0.0)
            else:
                for s in range(1, num_splits):
                    total += gl.load(part_ptr + s * stride + offs, mask=mask, other=0.0, cache_modifier=".cg")
            gl.atomic_xchg(count_ptr + tile, 0)
        return total, last

    @gluon.jit
    def _columns(m, tile, N, GATED: gl.constexpr, BM: gl.constexpr):
        """The weight column of tile row m: BM in a row, or gated, the rows g and g + 8 of each 16 (one warp's
        MMA rows) gate and up of one feature: BM // 2 features a tile."""
        if GATED:
            feature = tile * (BM // 2) + (m // 16) * 8 + m % 8
            col = feature + gl.where(m % 16 >= 8, N // 2, 0)
        else:
            col = tile * BM + m
        return col

    @gluon.jit
    def _int4_mma_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, N, K, k_per_split,
                         n_rows, x_stride, GROUP: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr,
                         MAX_SPLITS: gl.constexpr, GATED: gl.constexpr, R: gl.constexpr, PDL: gl.constexpr):
        dtype: gl.constexpr = x_ptr.dtype.element_ty
        BM: gl.constexpr = 64 * R  # weight columns a program: R MMA row tiles a warp
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        # words [BM rows, 16 int32s]: thread (warp w, lane 4g + c) holds rows 64i + 16w + g (+ 8), words c + 4u
        w_layout: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[8, 0], [0, 4], [0, 8]] + ([[64, 0]] if R == 2 else []),
            lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
            shape=[BM, 16])
        # rows' x [8 rows, 128 of K]: thread (lane 4r + c) holds row r, K 32u + 8c + e (e < 8); every warp all
        x_layout: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [0, 32], [0, 64]], lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[8, 128])
        tile = gl.program_id(0)
        split = gl.program_id(1)
        k_start = split * k_per_split
        steps = (gl.minimum(K, k_start + k_per_split) - k_start) // 128

        m = gl.arange(0, BM, layout=gl.SliceLayout(1, w_layout))
        col = _columns(m, tile, N, GATED, BM)
        kw = gl.arange(0, 16, layout=gl.SliceLayout(0, w_layout))
        w_ptrs = qw_ptr + ((k_start // 8 + kw)[None, :].to(gl.int64) * N + col[:, None])
        m_acc = gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
        col_acc = _columns(m_acc, tile, N, GATED, BM)
        group = k_start // GROUP if GROUP else 0
        # weights, zeros and scales (no kernel writes them) before the wait
        words = gl.load(w_ptrs)
        zq = _zero_pairs(z_ptr, group * N + col, dtype)
        scale = gl.load(s_ptr + group * N + col_acc).to(gl.float32)
        _wait_for_previous(PDL)

        r = gl.arange(0, 8, layout=gl.SliceLayout(1, x_layout))
        kk = gl.arange(0, 128, layout=gl.SliceLayout(0, x_layout))
        x_at = r[:, None] * x_stride + kk[None, :]
        x_mask = (r < n_rows)[:, None] & (kk < 128)[None, :]
        total = gl.zeros([BM, 8], gl.float32, mma)
        zero_acc = gl.zeros([BM, 8], gl.float32, mma)
        for step in range(steps):
            k0 = k_start + step * 128
            ahead = gl.minimum(step + 1, steps - 1) * 128  # the next step's words (the last step's again)
            next_words = gl.load(w_ptrs + (ahead // 8) * N)
            next_group = (k_start + ahead) // GROUP if GROUP else 0
            next_zq = _zero_pairs(z_ptr, next_group * N + col, dtype)
            next_scale = gl.load(s_ptr + next_group * N + col_acc).to(gl.float32)
            b = _rows(x_ptr, x_at, x_mask, k0, b_layout)
            a = _weights(words, gl.broadcast(zq[:, None], words)[0], dtype, a_layout, BM)
            total += mma_v2(a, b, zero_acc) * scale[:, None]
            words, zq, scale = next_words, next_zq, next_scale

        rr = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
        offs = rr[None, :] * N + col_acc[:, None]
        mask = (rr < n_rows)[None, :] & (m_acc < BM)[:, None]  # (the second term only gives the mask its shape)
        last = True
        if SPLIT:
            total, last = _sum_splits(total, part_ptr, count_ptr, tile, split, gl.num_programs(1), n_rows * N, offs,
                                      mask, MAX_SPLITS)
        if last:
            if HAS_BIAS:
                total += gl.load(bias_ptr + col_acc).to(gl.float32)[:, None]
            if GATED:  # silu_and_mul's rounding points: gate and up in the model dtype first
                both = gl.permute(gl.reshape(total, [BM // 16, 2, 8, 8]), (0, 2, 3, 1))  # [16s, g, row, gate | up]
                gate, up = gl.split(gl.reshape(both, [BM // 2, 8, 2]))
                gate = gate.to(dtype).to(gl.float32)
                act = (gate / (1.0 + gl.exp(-gate))).to(dtype).to(gl.float32)
                y = (act * up.to(dtype).to(gl.float32)).to(dtype)
                f = tile * (BM // 2) + gl.arange(0, BM // 2, layout=gl.SliceLayout(1, y.type.layout))
                ry = gl.arange(0, 8, layout=gl.SliceLayout(0, y.type.layout))
                gl.store(out_ptr + ry[None, :] * (N // 2) + f[:, None], y,
                         mask=(ry < n_rows)[None, :] & (f < N // 2)[:, None])
            else:
                gl.store(out_ptr + offs, total.to(dtype), mask=mask)


def _unsupported(x: torch.Tensor, qweight: torch.Tensor, group_size: int, r: int) -> str | None:
    """Why int4_mma cannot take x [rows, K] against qweight with R row tiles a warp, or None."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if r not in (1, 2):
        return f"int4_mma's R (MMA row tiles a warp) is 1 or 2, got {r}"
    if x.dim() != 2 or not 0 < x.shape[0] <= ROWS:
        return f"int4_mma takes 1 to {ROWS} rows, got {x.shape[0] if x.dim() == 2 else tuple(x.shape)}"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"int4_mma takes bfloat16 or float16 rows, got {x.dtype}"
    if x.stride(1) != 1 or x.stride(0) % 8:
        return "int4_mma reads rows contiguous along K, their stride a multiple of 8"
    if k % STEP or (group_size != k and group_size % STEP):
        return f"int4_mma takes K and groups in whole steps of {STEP}, got K = {k}, group_size {group_size}"
    if n % (64 * r):
        return f"int4_mma with R = {r} takes N in tiles of {64 * r}, got N = {n}"
    return None


def usable(x: torch.Tensor, qweight: torch.Tensor, group_size: int) -> bool:
    """Whether int4_mma takes this call with either config: an sm_90 GPU, and nothing _unsupported at R = 2 (1..ROWS
    rows of a 16-bit model contiguous along K, their stride a multiple of 8, K and the groups whole steps, N a
    multiple of both tiles)."""
    return gluon is not None and x.is_cuda and _unsupported(x, qweight, group_size, 2) is None and _sm90(x.device)


@functools.cache
def _sm90(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def int4_mma(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
             bias: torch.Tensor | None, counts: torch.Tensor | None = None, split_k: int = 0,
             gated: bool = False, config: tuple[int, int] | None = None) -> torch.Tensor:
    """int4_linear_ref for x [rows, K] (usable()) -> [rows, N], or gated silu_and_mul of it -> [rows, N // 2].
    counts: split-K counters for N // 64 tiles; split_k: the K splits (0: none from WHOLE_K_TILES tiles an SM,
    else about the config's programs an SM); config: (R, programs an SM), CONFIGS[gated] unless given."""
    r, programs_per_sm = config or CONFIGS[gated]
    problem = _unsupported(x, qweight, group_size, r)
    if problem:
        raise ValueError(problem)
    rows, k = x.shape
    n = qweight.shape[1]
    if x.data_ptr() % 16:
        x = x.clone()
    out = torch.empty((rows, n // 2 if gated else n), dtype=x.dtype, device=x.device)
    tiles = n // (64 * r)
    k_per_split, splits, part, counts = splitk.plan(tiles, k, STEP, (rows, n), out, counts, programs_per_sm, split_k,
                                                    WHOLE_K_TILES)
    _int4_mma_kernel[(tiles, splits)](
        x, qweight, scales, zeros, bias if bias is not None else scales, out, part, counts, n, k, k_per_split,
        rows, x.stride(0), GROUP=0 if group_size == k else group_size, HAS_BIAS=bias is not None,
        SPLIT=splits > 1, MAX_SPLITS=splitk.max_splits(splits),
        GATED=gated, R=r, num_warps=4, **pdl_args(x.device))
    return out
