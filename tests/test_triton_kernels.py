"""Triton kernels in kernels/ against their torch references.

Without a GPU they run under the Triton interpreter on the CPU. Triton reads
TRITON_INTERPRET when a kernel is decorated (at import of headrace.kernels),
so it is set here before any headrace or triton import, and also at the top of
tests/conftest.py, which imports headrace before this module is collected.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from headrace.kernels import sampling  # noqa: E402
from headrace.kernels.logprobs import (  # noqa: E402
    compute_scores, compute_scores_ref, fill_token_ids, fill_token_ids_ref, token_ranks, token_ranks_ref,
    top_logprobs, top_logprobs_ref,
)
from headrace.kernels.penalties import apply_penalties, apply_penalties_ref  # noqa: E402
from headrace.kernels.sampling import (  # noqa: E402
    gumbel_from_bits, gumbel_from_bits_ref, gumbel_ref, gumbel_sample, gumbel_sample_ref, uniform, uniform_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (rows, vocab): the kernels' vocabulary block is 1024, so 1000 is one partial
# block, 1024 exactly one, 2049 two and a 1-wide tail, 4099 four and a 3-wide tail.
SHAPES = [(1, 1), (3, 7), (33, 7), (2, 1000), (17, 1024), (5, 4099), (33, 1000), (1, 4099), (9, 2049), (33, 4099)]


def _gen(*key: int) -> torch.Generator:
    seed = 0
    for k in key:
        seed = seed * 100_003 + k
    return torch.Generator().manual_seed(seed)


def _mostly(g, n: int, off: float, draw: torch.Tensor) -> torch.Tensor:
    """Per slot either the off value or the drawn one, about half each."""
    return torch.where(torch.rand(n, generator=g) < 0.5, torch.full((n,), off), draw)


@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_apply_penalties(rows, vocab):
    g = _gen(1, rows, vocab)
    num_slots = rows + 5
    idx_mapping = torch.randperm(num_slots, generator=g)[:rows]
    logits = torch.randn(rows, vocab, generator=g) * 3  # negative and positive
    logits[torch.rand(rows, vocab, generator=g) < 0.05] = 0.0
    counts = torch.randint(0, 4, (num_slots, vocab), generator=g, dtype=torch.int32)
    counts[torch.rand(num_slots, vocab, generator=g) < 0.6] = 0
    prompt_mask = torch.rand(num_slots, vocab, generator=g) < 0.3
    repetition = _mostly(g, num_slots, 1.0, 0.5 + 1.5 * torch.rand(num_slots, generator=g))
    presence = _mostly(g, num_slots, 0.0, torch.rand(num_slots, generator=g) * 4 - 2)
    frequency = _mostly(g, num_slots, 0.0, torch.rand(num_slots, generator=g) * 2 - 1)
    first = idx_mapping[0]  # row 0 has every penalty on and a generated token 0
    repetition[first], presence[first], frequency[first], counts[first, 0] = 1.5, 0.5, 0.25, 2
    args = [t.to(DEVICE) for t in (idx_mapping, counts, prompt_mask, repetition, presence, frequency)]

    want = logits.clone()
    apply_penalties_ref(want, idx_mapping, counts, prompt_mask, repetition, presence, frequency)
    got = logits.clone().to(DEVICE)
    apply_penalties(got, *args)
    # Default float32 tolerances: fp32 division on the GPU need not be correctly rounded.
    torch.testing.assert_close(got.cpu(), want)
    assert not torch.equal(want[0], logits[0])  # the penalties did something


@pytest.mark.parametrize("k", [1, 3, 64, 129])
@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_compute_scores(rows, vocab, k, poisoned_empty):
    g = _gen(2, rows, vocab, k)
    logits = torch.randn(rows, vocab, generator=g) * torch.tensor([1.0, 30.0])[torch.arange(rows) % 2, None]
    logits[torch.rand(rows, vocab, generator=g) < 0.2] = float("-inf")  # filtered entries
    logits[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=g)] = 0.5  # no row all -inf
    token_ids = torch.randint(0, vocab, (rows, k), generator=g)
    token_ids[torch.rand(rows, k, generator=g) < 0.25] = -1
    act = torch.randint(0, 2, (rows,), generator=g, dtype=torch.int32)

    want = compute_scores_ref(logits, token_ids, act)
    got = compute_scores(logits.to(DEVICE), token_ids.to(DEVICE), act.to(DEVICE)).cpu()
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_token_ranks(rows, vocab, poisoned_empty):
    g = _gen(3, rows, vocab)
    # Quarter steps make many exact ties: a tie is not "strictly greater".
    logits = torch.round(torch.randn(rows, vocab, generator=g) * 4) / 4
    logits[torch.rand(rows, vocab, generator=g) < 0.1] = float("-inf")
    token_ids = torch.randint(0, vocab, (rows,), generator=g)
    want = token_ranks_ref(logits, token_ids)
    got = token_ranks(logits.to(DEVICE), token_ids.to(DEVICE)).cpu()
    assert got.dtype == torch.int64 and torch.equal(got, want)


@pytest.mark.parametrize("rows,vocab,n", [(r, v, n) for r, v in SHAPES for n in (0, 1, 5, 20) if n <= v]
                         + [(3, 151936, 5)])  # Qwen3's vocabulary: 75 chunks
def test_top_logprobs(rows, vocab, n, poisoned_empty):
    g = _gen(5, rows, vocab, n)
    logits = torch.randn(rows, vocab, generator=g) * torch.tensor([1.0, 30.0])[torch.arange(rows) % 2, None]
    logits[torch.rand(rows, vocab, generator=g) < 0.2] = float("-inf")  # filtered entries
    sampled = torch.randint(0, vocab, (rows,), generator=g)
    logits[torch.arange(rows), sampled] = 0.5  # sampled tokens are never -inf
    act = torch.randint(0, 2, (rows,), generator=g, dtype=torch.int32)
    want_i, want_f = top_logprobs_ref(logits, sampled, act, n)
    got_i, got_f = top_logprobs(logits.to(DEVICE), sampled.to(DEVICE), act.to(DEVICE), n)
    assert got_i.dtype == torch.int32 and got_f.dtype == torch.float32 and got_i.shape == (rows, n + 2)
    torch.testing.assert_close(got_f.cpu(), want_f, rtol=1e-5, atol=1e-5)
    finite = torch.isfinite(logits.gather(1, want_i[:, 1 : n + 1].long()))  # -inf logits tie: any is a top id
    assert torch.equal(got_i.cpu()[:, 1 : n + 1][finite], want_i[:, 1 : n + 1][finite])
    assert torch.equal(got_i.cpu()[:, [0, -1]], want_i[:, [0, -1]])  # sampled id, its rank


def test_top_logprobs_ties():
    """Tied logits: the top ids are distinct, hold the reference's values, and the rank counts strictly greater."""
    g = _gen(6)
    logits = torch.round(torch.randn(4, 5000, generator=g) * 2) / 2  # many exact ties
    sampled = torch.randint(0, 5000, (4,), generator=g)
    act = torch.zeros(4, dtype=torch.int32)
    want_i, want_f = top_logprobs_ref(logits, sampled, act, 20)
    got_i, got_f = (t.cpu() for t in top_logprobs(logits.to(DEVICE), sampled.to(DEVICE), act.to(DEVICE), 20))
    torch.testing.assert_close(got_f, want_f, rtol=1e-5, atol=1e-5)
    top = got_i[:, 1:21].long()
    assert all(len(set(r.tolist())) == 20 for r in top)
    assert torch.equal(logits.gather(1, top), logits.gather(1, want_i[:, 1:21].long()))
    assert torch.equal(got_i[:, [0, -1]], want_i[:, [0, -1]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sixteen_bit_logits_read_as_their_widening(dtype):
    """The sampler hands the LM head's 16-bit logits straight to these kernels:
    each must give exactly what it gives on the same logits widened to float32."""
    g = _gen(7)
    rows, vocab = 6, 5000
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    logits[0, 7] = float("-inf")
    wide = logits.float()
    sampled = torch.randint(0, vocab, (rows,), generator=g)
    act = torch.tensor([0, 1, 0, 0, 1, 0], dtype=torch.int32)
    seeds, positions = torch.randint(0, 2**40, (rows,), generator=g), torch.arange(rows) * 11
    temperature = torch.rand(rows, generator=g) + 0.3
    ids = torch.randint(0, vocab, (rows, 4), generator=g)
    for fn, args in [(gumbel_sample, (seeds, positions, temperature)), (gumbel_sample, (seeds, positions)),
                     (top_logprobs, (sampled, act, 5)), (compute_scores, (ids, act)), (token_ranks, (sampled,))]:
        args = tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args)
        got, want = fn(logits.to(DEVICE), *args), fn(wide.to(DEVICE), *args)
        for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want))):
            assert torch.equal(a.cpu(), b.cpu()), fn.__name__


@pytest.mark.parametrize("max_ids", [0, 1, 5, 20, 129])
@pytest.mark.parametrize("rows", [1, 4, 33])
def test_fill_token_ids(rows, max_ids, poisoned_empty):
    g = _gen(4, rows, max_ids)
    num_slots = rows + 7
    idx_mapping = torch.randperm(num_slots, generator=g)[:rows]
    slot_ids = torch.randint(0, 50_000, (num_slots, max_ids), generator=g, dtype=torch.int32)  # stale past n
    num_slot_ids = torch.randint(0, max_ids + 1, (num_slots,), generator=g, dtype=torch.int32)
    sampled = torch.randint(0, 50_000, (rows,), generator=g)
    want_ids, want_valid = fill_token_ids_ref(idx_mapping, slot_ids, num_slot_ids, sampled)
    got_ids, got_valid = fill_token_ids(*(t.to(DEVICE) for t in (idx_mapping, slot_ids, num_slot_ids, sampled)))
    assert got_ids.dtype == torch.int64 and got_valid.dtype == torch.bool
    assert torch.equal(got_ids.cpu(), want_ids)
    if max_ids == 0:
        # The reference's valid comes out [rows, 0] here (its ones_like(valid[:, :1]) of a
        # 0-wide valid); the documented shape is that of ids, column 0 always valid.
        want_valid = torch.ones_like(want_ids, dtype=torch.bool)
    assert torch.equal(got_valid.cpu().view(torch.uint8), want_valid.view(torch.uint8))


_SEED_EDGES = [0, 1, 2**32 - 1, 2**32, 2**63 - 1, -1, -(2**63), -123_456_789_012_345]


@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_uniform_bits_match(rows, vocab, poisoned_empty):
    g = _gen(5, rows, vocab)
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g)
    seeds[: len(_SEED_EDGES)] = torch.tensor(_SEED_EDGES)[:rows]
    positions = torch.randint(0, 2**40, (rows,), generator=g)
    positions[0] = 0
    want = uniform_ref(seeds, positions, vocab)
    got = uniform(seeds.to(DEVICE), positions.to(DEVICE), vocab).cpu()
    assert got.dtype == torch.float64 and torch.equal(got, want)


def test_gumbel_noise_matches_reference():
    from test_kernels import edge_bits

    bits = edge_bits()
    want = gumbel_from_bits_ref(bits)
    got = gumbel_from_bits(bits.to(DEVICE)).cpu()
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    # on the GPU the base-2 logs are lg2.approx's (two float32 ulps): 4.1e-7 from float64 at most, where the
    # reference's torch.log2 gives 2.7e-7 (an H100, 4 million bits)
    tol = 6e-7 if DEVICE == "cuda" else 4e-7
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


# Sampled tokens must equal the reference's unless the reference's top two
# values of logits + noise are this close (relative): the noise takes the same
# float32 steps in both, so a difference there is a last-bits one in log.
_NEAR_TIE = 1e-5


def _near_ties(logits, seeds, positions, temperature=None) -> torch.Tensor:  # [rows] bool
    """The rows whose top two values of logits + temperature * noise are within _NEAR_TIE."""
    vocab = logits.shape[1]
    values = logits + (1.0 if temperature is None else temperature[:, None]) * gumbel_ref(seeds, positions, vocab)
    top2 = values.topk(min(2, vocab), dim=-1).values
    return ((top2[:, 0] - top2[:, -1]) <= _NEAR_TIE * top2[:, 0].abs().clamp(min=1.0)) & (vocab > 1)


@pytest.mark.parametrize("with_temperature", [False, True])
@pytest.mark.parametrize("rows,vocab,sms", [(r, v, 0) for r, v in SHAPES] + [(40, 4099, 8)])
def test_gumbel_sample(rows, vocab, sms, with_temperature, poisoned_empty, monkeypatch):
    """sms: the SMs the launcher plans for (0: the device's). At 40 rows on 8, a row's vocabulary splits into
    two chunks of three 1024-wide blocks each."""
    if sms:
        monkeypatch.setattr(sampling, "num_sms", lambda device: sms)
        assert sampling._gumbel_num_chunks(rows, vocab, torch.device(DEVICE)) == 2
    g = _gen(6, rows, vocab)
    logits = torch.randn(rows, vocab, generator=g) * 2
    logits[torch.rand(rows, vocab, generator=g) < 0.3] = float("-inf")  # banned tokens
    logits[torch.arange(rows), torch.randint(0, vocab, (rows,), generator=g)] = 0.0  # no row all -inf
    if rows > 2 and vocab > 1:
        logits[1] = float("-inf")
        logits[1, vocab - 1] = 1.0  # the one allowed token is always sampled
        logits[2] = float("-inf")
        logits[2, [vocab // 2, vocab - 1]] = float("inf")  # an exact tie: the first index wins
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g)
    positions = torch.randint(0, 2**20, (rows,), generator=g)

    args = [logits, seeds, positions]
    if with_temperature:  # the kernel scales each row's noise by its temperature
        args.append(torch.rand(rows, generator=g) * 1.7 + 0.3)
    want = gumbel_sample_ref(*args)
    got = gumbel_sample(*(t.to(DEVICE) for t in args)).cpu()
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert ((got == want) | _near_ties(*args)).all(), (got, want)
    if rows > 2 and vocab > 1:
        assert got[1] == vocab - 1 and got[2] == vocab // 2


@pytest.mark.parametrize("fn", [gumbel_sample, gumbel_sample_ref])
def test_gumbel_sample_reads_seeds_and_temperatures_by_slot(fn):
    """With rows, each row's seed and temperature come from its slot's entry (the sample of the row-level
    call on the gathered values), and a slot's temperature 0 (greedy) takes the argmax of its logits."""
    g = _gen(7, 5, 3000)
    logits = torch.randn(5, 3000, generator=g)
    slot_seeds = torch.randint(-(2**63), 2**63 - 1, (9,), generator=g)
    slot_temps = torch.rand(9, generator=g) * 1.5 + 0.2
    rows = torch.tensor([4, 0, 7, 2, 8])
    slot_temps[7] = 0.0
    positions = torch.randint(0, 2**20, (5,), generator=g)
    want = gumbel_sample_ref(logits, slot_seeds[rows], positions, slot_temps[rows].clamp(min=0.2))
    want[2] = logits[2].argmax()
    got = fn(*(t.to(DEVICE) for t in (logits, slot_seeds, positions, slot_temps)), rows=rows.to(DEVICE)).cpu()
    assert got.tolist() == want.tolist()
    assert want[2] != gumbel_sample_ref(logits[2:3], slot_seeds[7:8], positions[2:3])[0]  # the noise would move it
    unscaled = fn(*(t.to(DEVICE) for t in (logits, slot_seeds, positions)), rows=rows.to(DEVICE)).cpu()
    assert unscaled.tolist() == gumbel_sample_ref(logits, slot_seeds[rows], positions).tolist()


def test_gumbel_sample_all_banned_row_is_token_0():
    logits = torch.full((2, 1500), float("-inf"))
    logits[1, 1234] = 0.0
    seeds, positions = torch.tensor([3, 4]), torch.tensor([5, 6])
    got = gumbel_sample(*(t.to(DEVICE) for t in (logits, seeds, positions))).cpu()
    assert got.tolist() == gumbel_sample_ref(logits, seeds, positions).tolist() == [0, 1234]


def test_gumbel_sample_counts_buffer_is_left_zero():
    """A counts buffer kept from call to call (the sampler's): calls of several row and chunk counts each
    sample the reference's tokens, the first maximal chunk's on ties across chunks, and leave every count at
    zero for the next."""
    counts = torch.zeros(40, dtype=torch.int32, device=DEVICE)
    for i, (rows, vocab) in enumerate([(1, 5000), (3, 3000), (33, 2049), (2, 1000), (40, 3000)]):
        g = _gen(8, rows, vocab)
        logits = torch.randn(rows, vocab, generator=g) * 2
        logits[0, [vocab // 3, vocab - 1]] = float("inf")  # tied, in different chunks when there are several
        seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g)
        positions = torch.randint(0, 2**20, (rows,), generator=g)
        got = gumbel_sample(*(t.to(DEVICE) for t in (logits, seeds, positions)), counts=counts).cpu()
        assert ((got == gumbel_sample_ref(logits, seeds, positions)) | _near_ties(logits, seeds, positions)).all(), i
        assert got[0] == vocab // 3
        assert not counts.any(), i
    with pytest.raises(ValueError, match="counts holds 40 entries for 41 rows"):
        gumbel_sample(torch.zeros(41, 100, device=DEVICE), torch.arange(41, device=DEVICE),
                      torch.arange(41, device=DEVICE), counts=counts)


@pytest.mark.parametrize("widths, block_size, heads, head_dim", [
    ([1], 4, 1, 8), ([2, 4], 8, 2, 16), ([4, 3, 1], 16, 2, 64), ([8], 16, 1, 32), ([5, 2], 4, 3, 24),
])
def test_copy_partial_blocks_matches_reference(widths, block_size, heads, head_dim):
    """Forks within groups where a beam is both a parent and a child: the
    kernel equals the reference, which reads everything before writing."""
    from headrace.kernels.beam import copy_partial_blocks, copy_partial_blocks_ref

    g = _gen(len(widths), block_size, head_dim)
    num_blocks = 2 * sum(widths) + 3
    kv = torch.randn(3, 2, num_blocks, block_size, heads, head_dim, generator=g)
    blocks = torch.randperm(num_blocks, generator=g)[: sum(widths)]  # each beam's own partial block
    src, dst, num, starts = [], [], [], [0]
    for w in widths:
        first = starts[-1]
        parents = torch.randint(0, w, (w,), generator=g).tolist()
        n = int(torch.randint(1, block_size, (1,), generator=g))
        for j, p in enumerate(parents):
            src.append(int(blocks[first + p]))
            dst.append(int(blocks[first + j]))
            num.append(0 if p == j else n)
        starts.append(first + w)
    args = [torch.tensor(x, dtype=torch.int64, device=DEVICE) for x in (src, dst, num, starts)]
    want, got = kv.clone().to(DEVICE), kv.clone().to(DEVICE)
    copy_partial_blocks_ref(want, *args, max(widths))
    copy_partial_blocks(got, *args, max(widths))
    assert torch.equal(got, want)
    assert not torch.equal(want.cpu(), kv) or all(n == 0 for n in num)


@pytest.mark.parametrize("rows, cols", [(1, 1), (3, 17), (8, 1024), (5, 4099), (2, 12288)])
def test_fp8_row_quantization_matches_reference(rows, cols):
    """The per-token FP8 quantizer: the same E4M3 values and scales as torch's, bit for bit."""
    from headrace.kernels.fp8 import quantize_rows, quantize_rows_triton

    g = _gen(rows, cols)
    x = (torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 50).to(DEVICE)
    x[0, :] = 0.0 if rows > 2 else x[0, :]  # an all-zero row keeps a finite scale
    for t in (x, x.bfloat16()):
        q, s = quantize_rows_triton(t)
        q_ref, s_ref = quantize_rows(t)
        assert torch.equal(s, s_ref)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_fp8_quantizers_round_every_e4m3_boundary_to_nearest_even():
    """Rows whose largest magnitude is 448 have a scale of 1, so the kernels round the values themselves:
    every E4M3 value, every midpoint between two neighbours (ties go to the even one) and the float32 just
    above and below each, both signs, through both of quantize_rows_triton's forms (a row held whole, and
    one of more than ONE_PASS columns in two passes), against torch's conversion."""
    from headrace.kernels.fp8 import FP8, ONE_PASS, quantize_rows_triton

    grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()  # 0 to 448
    base = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])
    near = torch.cat([base, torch.nextafter(base, torch.full_like(base, 1e9)), torch.nextafter(base, -base)])
    values = torch.cat([near, -near]).clamp(-448, 448)
    want = values.to(FP8).view(torch.uint8)
    row = torch.cat([torch.tensor([448.0]), values])
    for cols in (row.numel(), ONE_PASS + 5):
        x = row.repeat(-(-cols // row.numel()))[:cols].reshape(1, -1).to(DEVICE)
        q, scale = quantize_rows_triton(x)
        assert scale.item() == 1.0
        got = q.view(torch.uint8).cpu()[0, 1:1 + values.numel()]
        assert torch.equal(got, want), (values[got != want][:4], got[got != want][:4], want[got != want][:4])


def _assert_same_fp8(q, s, q_ref, s_ref):
    """Two per-token quantizations of nearly the same values (the kernel's rstd may differ from torch's in
    the last bit): scales within 1%, and each dequantized value within one E4M3 step of the reference's."""
    torch.testing.assert_close(s, s_ref, rtol=1e-2, atol=0)
    got, want = q.float() * s, q_ref.float() * s_ref
    near = (got - want).abs() <= want.abs() * 2.0**-3 + s_ref * 2.0**-6
    assert near.all(), (got - want).abs().max()


@pytest.mark.parametrize("rows, cols", [(1, 64), (3, 1000), (17, 4096), (2, 12288)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_norm_and_activation_quantized_in_one_launch(rows, cols, dtype):
    """rms_norm_quantize (with and without a residual, whose buffer receives x + residual) and
    silu_and_mul_quantize: the per-token quantization of what rms_norm_ref and silu_and_mul_ref give."""
    from headrace.kernels.activation import silu_and_mul_ref
    from headrace.kernels.fp8 import quantize_rows, rms_norm_quantize, silu_and_mul_quantize
    from headrace.kernels.norm import rms_norm_ref

    g = _gen(rows, cols)
    x = (torch.randn(rows, cols, generator=g) * 3).to(dtype)
    res = torch.randn(rows, cols, generator=g).to(dtype)
    w = (torch.rand(cols, generator=g) + 0.5).to(dtype)
    for residual in (None, res):
        buf = None if residual is None else residual.clone().to(DEVICE)
        q, s, nxt = rms_norm_quantize(x.to(DEVICE), w.to(DEVICE), 1e-6, buf)
        want = rms_norm_ref(x, w, 1e-6) if residual is None else rms_norm_ref(x, w, 1e-6, residual)[0]
        _assert_same_fp8(q.cpu(), s.cpu(), *quantize_rows(want))
        summed = x if residual is None else (x.float() + residual.float()).to(dtype)
        assert torch.equal(nxt.cpu(), summed) and (buf is None or nxt is buf)
    gate_up = (torch.randn(rows, 2 * cols, generator=g) * 3).to(dtype)
    q, s = silu_and_mul_quantize(gate_up.to(DEVICE))
    _assert_same_fp8(q.cpu(), s.cpu(), *quantize_rows(silu_and_mul_ref(gate_up)))


@pytest.mark.parametrize("m, k, n, bias", [(20, 1000, 130, True), (40, 512, 72, False)])
def test_fp8_mm_matches_reference(m, k, n, bias):
    """fp8_mm: E4M3 x E4M3 summed and scaled, against the same values multiplied in float64.
    20 rows take the 32-token tiles, multiplied as W x^T; 40 rows the 64-token ones; K = 1000 leaves a
    partial slice. On a GPU the tensor cores add E4M3 products at reduced precision (kernels/fp8.py):
    there 1% of the largest output is allowed."""
    from headrace.kernels.fp8 import fp8_mm, fp8_mm_ref, mm_config, quantize_rows
    from headrace.kernels.splitk import counters

    assert (mm_config(m, n, torch.device(DEVICE))[0] < 64) == (m <= 32)
    g = _gen(m, k, n)
    x_q, x_scale = quantize_rows(torch.randn(m, k, generator=g))
    w, w_scale = quantize_rows(torch.randn(n, k, generator=g) * 0.05)
    b = torch.randn(n, generator=g) if bias else None
    want = fp8_mm_ref(x_q, x_scale, w, w_scale, b)
    counts = counters(4 * n, DEVICE)
    args = [t.to(DEVICE) if t is not None else None for t in (x_q, x_scale, w, w_scale, b)]
    tol = 1e-2 if DEVICE == "cuda" else 1e-5
    for _ in range(2):  # the counters are back at zero after each call
        got = fp8_mm(*args, torch.float32, counts).cpu().double()
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
        assert not counts.any()


@pytest.mark.parametrize("m, k, n, bias, wide", [
    (1, 128, 64, False, False), (1, 3000, 40, True, False), (3, 200, 96, True, False), (3, 200, 96, True, True),
    (16, 1024, 40, True, False), (16, 1024, 40, True, True), (7, 4096, 130, False, False),
    (7, 4096, 130, False, True), (24, 512, 72, False, False), (24, 512, 72, False, True)])
def test_fp8_few_rows_matches_reference(m, k, n, bias, wide, monkeypatch):
    """The few-rows FP8 kernel: x (not quantized) times the E4M3 weights and their scales, summed in
    float32. K = 3000 and 200 leave a partial slice of K; K = 3000, 1024, 4096 and 512 are split;
    24 rows take the 32-row tiles. wide: the wide weight's config (DOT_WIDE_CONFIG), taken here by
    small weights."""
    from headrace.kernels import fp8
    from headrace.kernels.fp8 import fp8_few_rows, fp8_few_rows_ref, quantize_rows
    from headrace.kernels.splitk import counters

    if wide:
        monkeypatch.setattr(fp8, "WIDE_TILES_PER_SM", 0.001)
    assert fp8.wide(n, torch.device(DEVICE)) == wide

    g = _gen(m, k, n)
    x = torch.randn(m, k, generator=g)
    w, w_scale = quantize_rows(torch.randn(n, k, generator=g) * 0.05)
    b = torch.randn(n, generator=g) if bias else None
    want = fp8_few_rows_ref(x, w, w_scale, b)
    counts = counters(n, DEVICE)
    args = (x.to(DEVICE), w.to(DEVICE), w_scale.to(DEVICE), None if b is None else b.to(DEVICE))
    for _ in range(2):  # the counters are back at zero after each call
        got = fp8_few_rows(*args, counts=counts)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        assert not counts.any()
