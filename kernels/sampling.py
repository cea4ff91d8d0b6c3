"""Counter-based random numbers for sampling: torch reference and Triton kernels.

A request's noise at a position is a pure function of (seed, position,
token id), so its samples do not depend on which other requests share the
batch, on batch order, or on preemption and recompute. The hash is a
few rounds of a 32-bit integer mixer computed in int64 with every product
kept below 2**63, so it is exact on any backend.

Its 32 bits b make the uniform u = (b + 0.5) / 2**32 (uniform_ref, in
float64) and the Gumbel noise -log(-log(u)), computed in float32 from b
(gumbel_from_bits_ref) with two base-2 logarithms and no natural one: the
exponential draw -log(u) is -ln2 * log2(u) for b < 2**31, and for the upper
half, where u is near 1, the atanh series of -log1p(-t) in t = 1 - u, exact
in float32; the noise is -ln2 * log2 of that draw. On the GPU the base-2
logarithm is the hardware's approximate one (lg2.approx, about two float32
ulps): on an H100 the kernel takes 0.6 of the time it took with the
precise natural log; and the series' ratio t / (2 - t) comes from the
hardware reciprocal and one Newton step (3% off the kernel at 192-256 rows).
Under the interpreter they are tl.log2 and the division.

A sample is argmax(logits + temperature * noise): the same draw from
softmax(logits / temperature) as argmax(logits / temperature + noise),
without a division per logit.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from headrace.kernels.device import num_sms, pdl_args, wait_for_previous

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27, so (x < 2**32) * _MUL < 2**59


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = ((x >> 16) ^ x) * _MUL & _M32
    x = ((x >> 16) ^ x) * _MUL & _M32
    return (x >> 16) ^ x


def random_bits_ref(
    seeds: torch.Tensor,  # [num_rows] int64
    positions: torch.Tensor,  # [num_rows] int64, the position of the token being sampled
    vocab_size: int,
) -> torch.Tensor:  # [num_rows, vocab_size] int64 in [0, 2**32)
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    key = _mix32(lo ^ _mix32(hi ^ 0x9E3779B9))
    key = _mix32(key ^ (positions & _M32))  # [num_rows]
    tokens = _mix32(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) ^ 0x632BE5AB)
    return _mix32(key[:, None] ^ tokens[None, :])


def uniform_ref(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[num_rows, vocab_size] float64 in (0, 1): (bits + 0.5) / 2**32, exact."""
    return (random_bits_ref(seeds, positions, vocab_size).double() + 0.5) / 2.0**32


_INV_2_32 = 2.0**-32


_LN2 = math.log(2.0)
# -log1p(-t) = 2 atanh(s) for s = t / (2 - t) <= 1/3: 2 s (1 + s^2/3 + s^4/5 + ...), seven terms
# (the first left out is below 2**-25 of the sum)
_ATANH_TERMS = tuple(1.0 / (2 * k + 1) for k in range(7))


def gumbel_from_bits_ref(bits: torch.Tensor) -> torch.Tensor:  # int64 in [0, 2**32) -> float32
    """-log(-log((bits + 0.5) / 2**32)) in float32, within 4e-7 (relative, or
    absolute below 1) of float64 everywhere. The exponential draw is
    -ln2 * log2(u) below one half; above, from t = 1 - u (exact: the lower
    bits), the atanh series of -log1p(-t), which keeps its precision where u
    itself would round to 1."""
    low = bits < 2**31
    u = (bits.float() + 0.5) * _INV_2_32
    t = ((_M32 - bits).float() + 0.5) * _INV_2_32  # 1 - u
    s = t / (2.0 - t)
    s2 = s * s
    series = torch.full_like(s, _ATANH_TERMS[-1])
    for c in reversed(_ATANH_TERMS[:-1]):
        series = series * s2 + c
    e = torch.where(low, torch.log2(u) * -_LN2, (2.0 * s) * series)
    return torch.log2(e) * -_LN2


def gumbel_ref(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [num_rows, vocab_size] float32: argmax(logits + noise) samples softmax(logits)."""
    return gumbel_from_bits_ref(random_bits_ref(seeds, positions, vocab_size))


def gumbel_sample_ref(
    logits: torch.Tensor,  # [num_rows, vocab] float32: filtered (-inf = banned)
    seeds: torch.Tensor,  # [num_rows] int64
    positions: torch.Tensor,  # [num_rows] int64
    temperature: torch.Tensor | None = None,  # [num_rows] float32 > 0 (with rows: >= 0, 0 greedy); None: scaled
    rows: torch.Tensor | None = None,  # [num_rows] int64: seeds and temperature are per slot, read at rows
    counts: torch.Tensor | None = None,  # gumbel_sample's workspace; the reference has no chunks to count
) -> torch.Tensor:  # [num_rows] int64
    """Gumbel-max: argmax(logits + temperature * Gumbel noise) is a sample of softmax(logits / temperature).
    With rows, a temperature of 0 is a greedy row: its token is the argmax of its logits."""
    logits = logits.float()
    if rows is not None:
        seeds = seeds[rows]
        if temperature is not None:
            temperature = temperature[rows]
    noise = gumbel_ref(seeds, positions, logits.shape[-1])
    if temperature is not None:  # a greedy row's 0 leaves its logits as they are (the noise is finite)
        noise = temperature[:, None] * noise
    return (logits + noise).argmax(dim=-1)


# Triton. The hash is the same mixer on uint32: a uint32 product wraps modulo
# 2**32, which is exactly the reference's `* _MUL & _M32`, and `>>` on
# unsigned values is a logical shift, as on the reference's values in
# [0, 2**32). uniform() pins the bits against uniform_ref with torch.equal.
# The Gumbel noise takes gumbel_from_bits_ref's float32 steps; its base-2
# logs (lg2.approx on the GPU) may differ from torch's in the last two bits,
# which moves a sample only where the top two values of logits + noise tie
# to that precision.
_VOCAB_BLOCK = 1024
_INV_2_32_TL = tl.constexpr(_INV_2_32)  # readable inside kernels
_LN2_TL = tl.constexpr(_LN2)


@triton.jit
def _mix32_tl(x):
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _row_key(seeds_ptr, positions_ptr, row, seed_at=None):
    """The row's uint32 key: the reference's `key`, from its seed (at seed_at, else at row) and position."""
    seed = tl.load(seeds_ptr + (row if seed_at is None else seed_at))
    lo = seed.to(tl.uint32)  # int64 -> uint32 truncates: seed & _M32
    hi = (seed >> 32).to(tl.uint32)  # (seed >> 32) & _M32
    key = _mix32_tl(lo ^ _mix32_tl(hi ^ 0x9E3779B9))
    return _mix32_tl(key ^ tl.load(positions_ptr + row).to(tl.uint32))


@triton.jit
def _bits(key, token):
    """The hash's uint32 bits for int32 token ids and a uint32 key."""
    return _mix32_tl(key ^ _mix32_tl(token.to(tl.uint32) ^ 0x632BE5AB))


@triton.jit
def _log2(x, APPROX: tl.constexpr):
    """log2 of float32 x: the hardware's approximation with APPROX (a GPU), else tl.log2 (the interpreter)."""
    if APPROX:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return tl.log2(x)


@triton.jit
def _ratio(t, d, APPROX: tl.constexpr):
    """t / d for float32 d in [1, 2]: with APPROX the hardware's reciprocal and one Newton step on the
    exact residual t - s d (within an ulp of the rounded quotient, where the IEEE division takes a
    dozen instructions), else the division."""
    if APPROX:
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [d], dtype=tl.float32,
                                      is_pure=True, pack=1)
        s = t * r
        return tl.fma(tl.fma(-s, d, t), r, s)
    return t / d


@triton.jit
def _gumbel_f32(bits, APPROX: tl.constexpr):
    """gumbel_from_bits_ref, step for step in float32, for uint32 bits."""
    low = bits < 0x80000000
    u = (bits.to(tl.float32) + 0.5) * _INV_2_32_TL
    t = ((~bits).to(tl.float32) + 0.5) * _INV_2_32_TL  # ~bits = 2**32 - 1 - bits
    s = _ratio(t, 2.0 - t, APPROX)
    s2 = s * s
    series = 1.0 / 13.0  # _ATANH_TERMS, last first
    series = series * s2 + 1.0 / 11.0
    series = series * s2 + 1.0 / 9.0
    series = series * s2 + 1.0 / 7.0
    series = series * s2 + 1.0 / 5.0
    series = series * s2 + 1.0 / 3.0
    series = series * s2 + 1.0
    e = tl.where(low, _log2(u, APPROX) * -_LN2_TL, (2.0 * s) * series)
    return _log2(e, APPROX) * -_LN2_TL


@triton.jit
def _uniform_kernel(
    seeds_ptr, positions_ptr,
    out_ptr, out_stride,
    vocab_size,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    token = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    u = (_bits(_row_key(seeds_ptr, positions_ptr, row), token).to(tl.float64) + 0.5) / 4294967296.0
    tl.store(out_ptr + row * out_stride + token, u, mask=token < vocab_size)


def uniform(
    seeds: torch.Tensor,  # [num_rows] int64
    positions: torch.Tensor,  # [num_rows] int64, the position of the token being sampled
    vocab_size: int,
) -> torch.Tensor:  # [num_rows, vocab_size] float64 in (0, 1), bit-identical to uniform_ref
    num_rows = seeds.shape[0]
    out = torch.empty((num_rows, vocab_size), dtype=torch.float64, device=seeds.device)
    if num_rows == 0 or vocab_size == 0:
        return out
    grid = (num_rows, triton.cdiv(vocab_size, _VOCAB_BLOCK))
    _uniform_kernel[grid](seeds, positions, out, out.stride(0), vocab_size, BLOCK=_VOCAB_BLOCK)
    return out


@triton.jit
def _gumbel_from_bits_kernel(bits_ptr, out_ptr, n, BLOCK: tl.constexpr, APPROX: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bits = tl.load(bits_ptr + i, mask=i < n, other=0).to(tl.uint32)
    tl.store(out_ptr + i, _gumbel_f32(bits, APPROX), mask=i < n)


def gumbel_from_bits(bits: torch.Tensor) -> torch.Tensor:  # [n] int64 in [0, 2**32) -> [n] float32
    """The sampling kernel's noise for given bits, against gumbel_from_bits_ref."""
    out = torch.empty(bits.shape, dtype=torch.float32, device=bits.device)
    if bits.numel():
        _gumbel_from_bits_kernel[(triton.cdiv(bits.numel(), _VOCAB_BLOCK),)](bits, out, bits.numel(),
                                                                            BLOCK=_VOCAB_BLOCK, APPROX=bits.is_cuda)
    return out


@triton.jit
def _chunk_best(x_ptr, lo, hi, key, temperature, NOISE: tl.constexpr, SCALED: tl.constexpr, BLOCK: tl.constexpr,
                APPROX: tl.constexpr):
    """Per lane, the best value of x (plus temperature * noise with NOISE and SCALED, the noise alone with
    NOISE only) over tokens lo..hi-1 and its token: [BLOCK] float32, [BLOCK] int32.
    A lane keeps its earlier (smaller) token on a tie, and the caller takes the
    smallest token among the lanes that reach the maximum, so ties resolve to the
    first maximal token, as torch.argmax does. A chunk of only -inf yields its
    first token, so a row of only -inf samples token 0, as torch.argmax."""
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = lo + offs
    for start in range(lo, hi, BLOCK):
        token = start + offs
        mask = token < hi
        v = tl.load(x_ptr + token, mask=mask, other=float("-inf")).to(tl.float32)
        if NOISE:
            noise = _gumbel_f32(_bits(key, token), APPROX)
            if SCALED:
                noise = temperature * noise
            v = tl.where(mask, v + noise, float("-inf"))
        better = v > best
        best = tl.where(better, v, best)
        best_idx = tl.where(better, token, best_idx)
    return best, best_idx


@triton.jit(do_not_specialize=["num_chunks"])
def _gumbel_sample_kernel(
    logits_ptr, logits_stride,
    seeds_ptr, positions_ptr, temperature_ptr, rows_ptr,
    part_val_ptr, part_idx_ptr,  # [num_rows, num_chunks]: each chunk's best value and its token
    out_ptr,  # [num_rows] int64: the sampled tokens
    count_ptr,  # [num_rows] int32, zero: the chunks of each row done so far (left zero)
    vocab_size, chunk_size, num_chunks,
    HAS_TEMPERATURE: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr, APPROX: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (row, chunk of the vocabulary), so that small batches
    still fill the GPU. Each stores its chunk's best value and token; the last
    of a row's chunks to finish (an atomic count) picks the first chunk with the
    largest value and writes the row's token. With HAS_ROWS, seeds and
    temperatures are per slot, read at rows[row], and a slot's temperature 0
    (a greedy row) takes the argmax of the logits: no noise is made for it."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    src = tl.load(rows_ptr + row) if HAS_ROWS else row
    key = _row_key(seeds_ptr, positions_ptr, row, src)
    temperature = 1.0
    if HAS_TEMPERATURE:
        temperature = tl.load(temperature_ptr + src)
    lo = chunk * chunk_size
    hi = tl.minimum(lo + chunk_size, vocab_size)
    x_ptr = logits_ptr + row * logits_stride
    offs = tl.arange(0, BLOCK)
    greedy = False  # known at compile time unless temperatures are read by slot
    if HAS_ROWS and HAS_TEMPERATURE:
        greedy = temperature == 0
    if greedy:
        best, best_idx = _chunk_best(x_ptr, lo, hi, key, temperature, False, HAS_TEMPERATURE, BLOCK, APPROX)
    else:
        best, best_idx = _chunk_best(x_ptr, lo, hi, key, temperature, True, HAS_TEMPERATURE, BLOCK, APPROX)
    top = tl.max(best, axis=0)
    winner = tl.min(tl.where(best == top, best_idx, vocab_size), axis=0)
    if num_chunks == 1:
        tl.store(out_ptr + row, winner.to(tl.int64))
    else:
        tl.store(part_val_ptr + row * num_chunks + chunk, top)
        tl.store(part_idx_ptr + row * num_chunks + chunk, winner.to(tl.int64))
        tl.debug_barrier()  # the stores made before the count says so
        if tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == num_chunks - 1:
            # chunk c's tokens precede chunk c + 1's: the smallest token among the maximal chunks is the
            # first maximal chunk's, which torch.argmax over the chunks would take
            row_top = tl.full([], float("-inf"), tl.float32)
            row_token = tl.zeros([], tl.int64) + vocab_size  # vocab_size may be the constexpr 1
            for c0 in range(0, num_chunks, BLOCK):
                c = c0 + offs
                val = tl.load(part_val_ptr + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"),
                              cache_modifier=".cg")
                idx = tl.load(part_idx_ptr + row * num_chunks + c, mask=c < num_chunks, other=vocab_size,
                              cache_modifier=".cg")
                block_top = tl.max(val, axis=0)
                block_token = tl.min(tl.where(val == block_top, idx, vocab_size), axis=0)
                take = (block_top > row_top) | ((block_top == row_top) & (block_token < row_token))
                row_token = tl.where(take, block_token, row_token)
                row_top = tl.maximum(row_top, block_top)
            tl.store(out_ptr + row, row_token)
            tl.atomic_xchg(count_ptr + row, 0)


def _gumbel_num_chunks(num_rows: int, vocab_size: int, device: torch.device) -> int:
    """Enough (row, chunk) programs for eight per SM (the hash and the logs
    need the occupancy to hide their latency), in whole BLOCKs of the vocabulary."""
    return max(1, min(-(-vocab_size // _VOCAB_BLOCK), -(-8 * num_sms(device) // num_rows)))


def gumbel_sample(
    logits: torch.Tensor,  # [num_rows, vocab] float32, or the model's 16-bit dtype: filtered (-inf = banned)
    seeds: torch.Tensor,  # [num_rows] int64
    positions: torch.Tensor,  # [num_rows] int64
    temperature: torch.Tensor | None = None,  # [num_rows] float32 > 0 (with rows: >= 0, 0 greedy); None: scaled
    rows: torch.Tensor | None = None,  # [num_rows] int64: seeds and temperature are per slot, read at rows
    counts: torch.Tensor | None = None,  # int32 [>= num_rows], zero, left zero: a buffer kept from call to call
) -> torch.Tensor:  # [num_rows] int64
    """Triton version of gumbel_sample_ref: argmax(logits + temperature *
    Gumbel noise), noise from the same hash, in one pass over the logits and
    one launch (without counts, a zeroed buffer is made for the call)."""
    num_rows, vocab_size = logits.shape
    assert logits.stride(-1) == 1
    if num_rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    num_chunks = _gumbel_num_chunks(num_rows, vocab_size, logits.device)
    chunk_size = -(-vocab_size // (num_chunks * _VOCAB_BLOCK)) * _VOCAB_BLOCK
    num_chunks = -(-vocab_size // chunk_size)
    # The arguments keep their dtypes whatever the chunk count, so a batch size first met mid-run compiles
    # nothing; with one chunk a row's program writes its token and neither partials nor counts are read.
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    part_val = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(num_rows, num_chunks, dtype=torch.int64, device=logits.device)
    if counts is None:
        counts = torch.zeros(num_rows if num_chunks > 1 else 0, dtype=torch.int32, device=logits.device)
    elif counts.numel() < num_rows:
        raise ValueError(f"gumbel_sample: counts holds {counts.numel()} entries for {num_rows} rows")
    _gumbel_sample_kernel[(num_rows, num_chunks)](
        logits, logits.stride(0), seeds, positions, logits if temperature is None else temperature,
        positions if rows is None else rows, part_val, part_idx, out, counts, vocab_size, chunk_size, num_chunks,
        HAS_TEMPERATURE=temperature is not None, HAS_ROWS=rows is not None, BLOCK=_VOCAB_BLOCK,
        APPROX=logits.is_cuda, num_warps=8, **pdl_args(logits.device),
    )
    return out
