"""The int4 (w4a16) linear kernel against its torch reference, and its layout helpers.

Without a GPU the kernel runs under the Triton interpreter, which is set
before any headrace or triton import (see tests/test_triton_kernels.py). The
interpreter's tl.dot mishandles bfloat16, so on the CPU the 16-bit dtype is
float16; on a GPU both are tested.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from headrace.kernels.int4 import (  # noqa: E402
    _CONFIGS, _launch, dequantize_int4, int4_linear, int4_linear_ref, pack_int4, split_k_tiles, unpack_int4,
)
from headrace.kernels.int4_gemv import int4_gemv  # noqa: E402
from headrace.kernels.splitk import counters  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])

# (M, K, N, G). Decode sizes (M <= 16) split K; 40 and 200 are K = G with a
# partial last slice of K; G = 16 forces 16-wide slices; N = 40 and 96 leave
# partial tiles of N; M = 100, 200, 300 reach the prefill configs.
SHAPES = [(0, 64, 40, 64), (1, 256, 40, 128), (1, 40, 96, 40), (3, 128, 96, 16), (3, 256, 40, 256),
          (16, 64, 40, 32), (16, 512, 96, 128), (33, 200, 96, 200), (33, 96, 40, 32), (100, 64, 96, 16),
          (200, 128, 40, 128), (300, 96, 40, 32)]
if DEVICE == "cuda":
    SHAPES += [(1, 4096, 1000, 128), (7, 2048, 3000, 32), (16, 1536, 4096, 1536), (64, 1024, 512, 64),
               (513, 2048, 1000, 128), (2048, 1024, 2048, 128)]


def _layer(k: int, n: int, g: int, dtype: torch.dtype, seed: int):
    """Random (qweight, scales, zeros) on DEVICE, with every value 0..15 and zeros 0..15."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(k // g, n, generator=gen) * 0.02 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (k // g, n), generator=gen).to(dtype)
    return pack_int4(q).to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE)


def _assert_near(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Each output may differ by u * sum_k |x| |W|: for 16-bit dtypes the rounding
    of W (half an eps per term, which the kernel may skip) and of y in each
    (half an eps each), so u = 2 eps; for float32 only the order of the K
    additions differs, u = eps * sqrt(K)."""
    eps = torch.finfo(x.dtype).eps
    u = 2 * eps if x.element_size() == 2 else eps * x.shape[-1] ** 0.5
    bound = x.double().abs() @ w.double().abs().t()  # [M, N]
    err = (got.double() - want.double()).abs()
    assert got.shape == want.shape and got.dtype == want.dtype
    assert bool((err <= u * bound + 1e-30).all()), f"max error {err.max():.3g}, allowed {(u * bound).max():.3g}"


def test_pack_unpack_round_trip():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 24), generator=gen, dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (8, 24)
    assert torch.equal(unpack_int4(packed), q)
    q[:8, 0] = torch.tensor([1, 2, 3, 4, 5, 6, 7, 15])  # high nibble 15: the int32 is negative
    assert pack_int4(q)[0, 0].item() == 0xF7654321 - 2**32
    assert torch.equal(unpack_int4(pack_int4(q.to(torch.int64))), q)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(torch.zeros(12, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..15"):
        pack_int4(torch.full((8, 4), 16))


def test_dequantize_matches_formula():
    k, n, g = 64, 6, 16
    qweight, scales, zeros = (t.cpu() for t in _layer(k, n, g, torch.float32, seed=1))
    got = dequantize_int4(qweight, scales, zeros, g, torch.float32)
    want = torch.empty(n, k)
    for kk in range(k):
        for nn in range(n):
            q = (int(qweight[kk // 8, nn]) >> (4 * (kk % 8))) & 0xF
            want[nn, kk] = (q - zeros[kk // g, nn].item()) * scales[kk // g, nn].item()
    assert torch.equal(got, want)
    assert dequantize_int4(qweight, scales, zeros, g, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("m,k,n,g", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_linear(m, k, n, g, dtype):
    seed = m * 1_000_003 + k * 1009 + n * 7 + g
    qweight, scales, zeros = _layer(k, n, g, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    bias = (torch.randn(n, generator=gen) * (0.0 if seed % 2 else 1.0)).to(dtype).to(DEVICE)
    w = dequantize_int4(qweight, scales, zeros, g, dtype)
    for b in (None, bias):
        got = int4_linear(x, qweight, scales, zeros, g, b)
        _assert_near(got, int4_linear_ref(x, qweight, scales, zeros, g, b), x, w)


@pytest.mark.parametrize("m", [5, 33])
def test_every_config_and_split(m, monkeypatch):
    """Each config of the table on one shape, with K split 1 or 3 ways; torch.empty
    returns NaN-filled memory, so an output or partial left unwritten shows. The
    split-K counters are back at zero after every call."""
    k, n, g = 384, 72, 64
    qweight, scales, zeros = _layer(k, n, g, torch.float16, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).half().to(DEVICE)
    bias = torch.randn(n).half().to(DEVICE)
    want = int4_linear_ref(x, qweight, scales, zeros, g, bias)
    w = dequantize_int4(qweight, scales, zeros, g, torch.float16)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    counts = counters(split_k_tiles(n), DEVICE)
    for _, cfg in _CONFIGS:
        for split_k in (1, 3):
            _assert_near(_launch(x, qweight, scales, zeros, g, bias, cfg._replace(split_k=split_k), counts),
                         want, x, w)
            assert not counts.any()


# (K, N, G): K = G of a width that is no power of two (its last slice masked); G = 16 (slices spanning 8
# groups); G = 48 (no power of two: slices start inside groups); N leaving a partial tile, and N in whole
# tiles (no masks); on the GPU, the Qwen3-8B o_proj width.
GEMV_SHAPES = [(256, 40, 128), (40, 96, 40), (200, 72, 200), (128, 40, 16), (512, 130, 64), (288, 40, 16),
               (256, 128, 64), (240, 72, 48)]
if DEVICE == "cuda":
    GEMV_SHAPES += [(4096, 1000, 128), (1024, 4096, 1024)]


# float16 on every shape; bfloat16 (no tl.dot here, so the interpreter runs it too) on a partial last slice with a
# partial tile, and on whole tiles
GEMV_CASES = ([(*shape, torch.float16) for shape in GEMV_SHAPES]
              + [(*shape, torch.bfloat16) for shape in GEMV_SHAPES if shape in ((200, 72, 200), (256, 128, 64))])
if DEVICE == "cuda":
    GEMV_CASES += [(*shape, torch.bfloat16) for shape in GEMV_SHAPES if (*shape, torch.bfloat16) not in GEMV_CASES]


@pytest.mark.parametrize("k,n,g,dtype", GEMV_CASES)
def test_one_row_gemv(k, n, g, dtype, monkeypatch):
    """The one-row kernel that int4_linear runs for a single 16-bit row, with K whole or split 3, 7 and 20
    ways (and as many as it picks), and in another config; torch.empty returns NaN-filled memory, so an
    output or partial left unwritten shows, and the split-K counters are back at zero after every call."""
    qweight, scales, zeros = _layer(k, n, g, dtype, seed=k + n + g)
    gen = torch.Generator().manual_seed(k * n)
    x = (torch.randn(1, k, generator=gen) * 4).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    w = dequantize_int4(qweight, scales, zeros, g, dtype)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    counts = counters(split_k_tiles(n), DEVICE)
    for b in (None, bias):
        want = int4_linear_ref(x, qweight, scales, zeros, g, b)
        for split_k in (0, 1, 3, 7, 20):  # 20: past the unrolled sum, the loop
            _assert_near(int4_gemv(x, qweight, scales, zeros, g, b, counts, split_k), want, x, w)
            assert not counts.any()
        # other configs, as benchmarks/int4_kernel.py --sweep runs them: narrower tiles and slices, 2 warps; and
        # slices of 256 (spanning groups where G < 256: each int32 row takes its own group's scale and zero)
        _assert_near(int4_gemv(x, qweight, scales, zeros, g, b, config=(32, 64, 2, 4)), want, x, w)
        for split_k in (0, 3):
            _assert_near(int4_gemv(x, qweight, scales, zeros, g, b, counts, split_k, config=(64, 256, 4, 8)),
                         want, x, w)
            assert not counts.any()
        got = int4_linear(x[None], qweight, scales, zeros, g, b, counts)  # [1, 1, K]: the kernel int4_linear picks
        _assert_near(got[0], want, x, w)


def test_one_row_gemv_stages():
    """The one-row kernel's K loop pipelined 2 or 3 stages (benchmarks/int4_kernel.py --stages) gives the default's
    bits and stays near the reference, with K whole and split; fewer than one stage is refused by name."""
    k, n, g = 512, 128, 128
    qweight, scales, zeros = _layer(k, n, g, torch.bfloat16, seed=11)
    x = (torch.randn(1, k, generator=torch.Generator().manual_seed(11)) * 4).to(torch.bfloat16).to(DEVICE)
    w = dequantize_int4(qweight, scales, zeros, g, torch.bfloat16)
    want = int4_linear_ref(x, qweight, scales, zeros, g, None)
    counts = counters(split_k_tiles(n), DEVICE)
    for split_k in (1, 2):
        default = int4_gemv(x, qweight, scales, zeros, g, None, counts, split_k)
        for stages in (2, 3):
            got = int4_gemv(x, qweight, scales, zeros, g, None, counts, split_k, stages=stages)
            assert torch.equal(got, default)
            _assert_near(got, want, x, w)
            assert not counts.any()
    with pytest.raises(ValueError, match="int4_gemv's K loop takes 1 or more stages, got 0"):
        int4_gemv(x, qweight, scales, zeros, g, None, counts, stages=0)


def _f32_sums_bound(x: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """What the one-row kernel's float32 sums may be off by (float64, [1, N]): it adds exact weights against an
    offset of at most 2^11 (kernels/int4_gemv.py), so at most 2^-9 of sum_k |x_k| scale_k."""
    return (x.double().abs() @ scales.double().repeat_interleave(group, dim=0)) * 2**-9


def _gated_bound(gu: torch.Tensor, d_sums: torch.Tensor, half_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """gu [rows, N] float64 (gate, then up) -> (silu(gate) * up, what a kernel's SiLU-and-mul may be off by): gate
    and up within d_sums (the float32 sums' error) and one rounding to the model dtype, SiLU rounded, the product
    rounded."""
    d_gu = d_sums + half_eps * (gu.abs() + d_sums)
    n = gu.shape[1]
    (gate, up), (dg, du) = gu.split(n // 2, dim=1), d_gu.split(n // 2, dim=1)
    act = torch.nn.functional.silu(gate)
    d_act = 1.1 * dg + half_eps * (act.abs() + 1.1 * dg)
    allowed = d_act * (up.abs() + du) + act.abs() * du
    return act * up, allowed + half_eps * ((act * up).abs() + allowed)


# (K, N, G): a partial last tile of features (N / 2 = 40 and 65), K = G (its last slice masked), G = 16, whole
# tiles; on the GPU a wide layer whose K is not split.
GATED_SHAPES = [(256, 80, 128), (40, 96, 40), (128, 40, 16), (256, 128, 64)]
GATED_SPLITS = (0, 3)  # K whole, and split (the last split's program applies SiLU-and-mul)
if DEVICE == "cuda":
    GATED_SHAPES += [(512, 130, 64), (1024, 2 * 64 * 132 * 2, 128)]
    GATED_SPLITS = (0, 1, 3, 20)  # and past the unrolled sum of the partials


@pytest.mark.parametrize("k,n,g", GATED_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_one_row_gemv_gated(k, n, g, dtype, monkeypatch):
    """The one-row kernel with SiLU-and-mul in its epilogue (gate|up: gate the first half of the outputs),
    K whole and split (GATED_SPLITS), with and without bias, against the dequantized float64 layer: gate and up
    within the float32 sums' bound, then rounded to dtype (half an eps), SiLU rounded and the product rounded.
    torch.empty returns NaN-filled memory, and the split-K counters are back at zero after every call."""
    qweight, scales, zeros = _layer(k, n, g, dtype, seed=k + n + g)
    gen = torch.Generator().manual_seed(k * n)
    x = (torch.randn(1, k, generator=gen) * 2).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    w = dequantize_int4(qweight, scales, zeros, g, torch.float64)
    half_eps = torch.finfo(dtype).eps / 2
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    counts = counters(split_k_tiles(n), DEVICE)
    for b in (None, bias):
        want, allowed = _gated_bound(x.double() @ w.t() + (0 if b is None else b.double()),
                                     _f32_sums_bound(x, scales, g), half_eps)
        for split_k in GATED_SPLITS:
            got = int4_gemv(x, qweight, scales, zeros, g, b, counts, split_k, gated=True)
            assert got.shape == (1, n // 2) and got.dtype == dtype
            err = (got.double() - want).abs()
            assert bool((err <= allowed).all()), f"split {split_k}: max error {err.max():.3g}"
            assert not counts.any()
    with pytest.raises(ValueError, match="as many up as gate outputs"):
        int4_gemv(x, qweight[:, :n - 1].contiguous(), scales[:, :n - 1].contiguous(),
                  zeros[:, :n - 1].contiguous(), g, None, gated=True)


def test_one_row_gemv_leaves_k_whole_for_wide_layers(monkeypatch):
    """From WHOLE_K_TILES output tiles an SM (as gate|up has) the one-row kernel runs K unsplit, and its
    result is the reference's; narrower layers split K as before."""
    from headrace.kernels import int4_gemv as gemv_module

    picked = []  # the split counts planned
    real_plan = gemv_module.splitk.plan

    def plan(*a):
        planned = real_plan(*a)
        picked.append(planned[1])
        return planned

    monkeypatch.setattr(gemv_module.splitk, "plan", plan)
    sms = 3  # a small GPU, to keep the layers small
    monkeypatch.setattr(gemv_module.splitk, "num_sms", lambda device: sms)
    block_n = gemv_module.CONFIG[0]
    wide = gemv_module.WHOLE_K_TILES * sms * block_n
    for n, whole in ((wide, True), (wide - block_n, False)):
        k, g = 256, 128
        qweight, scales, zeros = _layer(k, n, g, torch.float16, seed=n)
        x = (torch.randn(1, k, generator=torch.Generator().manual_seed(n)) * 4).half().to(DEVICE)
        want = int4_linear_ref(x, qweight, scales, zeros, g, None)
        _assert_near(int4_gemv(x, qweight, scales, zeros, g, None), want, x,
                     dequantize_int4(qweight, scales, zeros, g, torch.float16))
        assert (picked[-1] == 1) == whole, (n, picked[-1])


def test_strided_and_batched_x_and_reproducible():
    k, n, g = 128, 40, 32
    qweight, scales, zeros = _layer(k, n, g, torch.float32, seed=3)
    wide = torch.randn(2, 3, k + 8, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    x = wide[..., :k]  # rows k + 8 apart, last dimension contiguous
    got = int4_linear(x, qweight, scales, zeros, g, None)
    assert got.shape == (2, 3, n)
    want = int4_linear_ref(x.contiguous(), qweight, scales, zeros, g, None)
    _assert_near(got.reshape(6, n), want.reshape(6, n), x.reshape(6, k), dequantize_int4(qweight, scales, zeros, g,
                                                                                           torch.float32))
    assert torch.equal(got, int4_linear(x, qweight, scales, zeros, g, None))


@pytest.mark.parametrize("fn", [int4_linear, int4_linear_ref])
def test_bad_input(fn):
    k, n, g = 64, 16, 32
    qweight, scales, zeros = _layer(k, n, g, torch.float32, seed=4)
    x = torch.randn(2, k, device=DEVICE)
    cases = [
        ((x[:, :56], qweight, scales, zeros, g, None), "qweight has 8 rows, so K = 64, but x has K = 56"),
        ((x, qweight, scales[:1], zeros, g, None), r"scales must be floating \[K // group_size, N\] = \[2, 16\]"),
        ((x, qweight, scales, zeros[:, :8], g, None), "zeros must be"),
        ((x, qweight, scales, zeros, 48, None), "group_size 48 does not divide K = 64"),
        ((x, qweight, scales, zeros, 0, None), "group_size 0 does not divide"),
        ((x, qweight.float(), scales, zeros, g, None), "qweight must be 2-d int32"),
        ((x, qweight, scales, zeros, g, torch.zeros(n + 1, device=DEVICE)), r"bias must be \[N\] = \[16\]"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            fn(*args)
    if fn is int4_linear:
        with pytest.raises(ValueError, match="contiguous in its last dimension"):
            fn(torch.randn(k, 2, device=DEVICE).t(), qweight, scales, zeros, g, None)
        with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
            fn(x.double(), qweight, scales, zeros, g, None)


@pytest.mark.parametrize("k, n, group", [(64, 40, 16), (256, 96, 128), (96, 130, 96)])
def test_triton_dequantization_matches_reference(k, n, group):
    """The many-rows path's W^T, bit for bit the reference's dequantized weights."""
    from headrace.kernels.int4 import dequantize_int4, dequantize_int4_triton, pack_int4

    g = torch.Generator().manual_seed(k + n)
    q = torch.randint(0, 16, (k, n), generator=g)
    scales = torch.rand(k // group, n, generator=g) * 0.01
    zeros = torch.randint(0, 17, (k // group, n), generator=g).float()
    args = (pack_int4(q).to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), group)
    for dtype in (torch.float32, torch.float16):
        assert torch.equal(dequantize_int4_triton(*args, dtype).t(), dequantize_int4(*args, dtype))


_SM90 = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)
# (rows, K, N, G, split_k, dtype): groups of one step, of several and one group for all of K; K whole, split as
# planned (Qwen3-8B's down: 16 splits), 3 ways and 20 (past the unrolled sum of the partials).
MMA_CASES = [(2, 256, 128, 128, 0, torch.bfloat16), (3, 1024, 384, 128, 3, torch.float16),
             (8, 512, 256, 512, 1, torch.bfloat16), (5, 12288, 4096, 128, 0, torch.bfloat16),
             (8, 2560, 128, 128, 20, torch.float16)]


@pytest.mark.skipif(not _SM90, reason="kernels/int4_mma.py runs on an sm_90 GPU (Gluon: no interpreter)")
@pytest.mark.parametrize("rows,k,n,g,split_k,dtype", MMA_CASES)
def test_mma_rows(rows, k, n, g, split_k, dtype, monkeypatch):
    """The tensor-core kernel against int4_linear_ref, with and without bias: within two eps of sum_k |x| |W|
    (+ |b|), the reference's rounding of W and of y and the kernel's of y. The split-K counters are back at zero
    after every call, NaN-filled memory from torch.empty does not leak into the result, two calls give the same
    bits, and int4_linear sends these rows to it unless HEADRACE_INT4_MMA=0."""
    from headrace.kernels import int4 as int4_module
    from headrace.kernels.int4_mma import int4_mma

    qweight, scales, zeros = _layer(k, n, g, dtype, seed=rows + k + n)
    gen = torch.Generator().manual_seed(k * n + rows)
    x = (torch.randn(rows, k, generator=gen) * 2).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    w = dequantize_int4(qweight, scales, zeros, g, dtype)
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    counts = counters(split_k_tiles(n), DEVICE)
    bound = x.double().abs() @ w.double().abs().t()
    for b in (None, bias):
        want = int4_linear_ref(x, qweight, scales, zeros, g, b)
        got = int4_mma(x, qweight, scales, zeros, g, b, counts, split_k)
        assert got.shape == want.shape and got.dtype == dtype
        allowed = 2 * torch.finfo(dtype).eps * (bound + (0 if b is None else b.double().abs()))
        err = (got.double() - want.double()).abs()
        assert bool((err <= allowed).all()), f"max error {err.max():.3g}"
        assert torch.equal(got, int4_mma(x, qweight, scales, zeros, g, b, counts, split_k))
        assert not counts.any()
    calls = []
    real = int4_module.int4_mma.int4_mma
    monkeypatch.setattr(int4_module.int4_mma, "int4_mma", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    int4_linear(x, qweight, scales, zeros, g, None, counts)
    monkeypatch.setenv("HEADRACE_INT4_MMA", "0")
    int4_linear(x, qweight, scales, zeros, g, None, counts)
    assert calls == [1]


@pytest.mark.skipif(not _SM90, reason="kernels/int4_mma.py runs on an sm_90 GPU (Gluon: no interpreter)")
@pytest.mark.parametrize("rows,k,n,g,split_k,dtype", [
    (2, 256, 256, 128, 0, torch.bfloat16), (7, 1024, 512, 128, 3, torch.float16),
    (8, 512, 2 * 64 * 132 * 2 * 2, 128, 0, torch.bfloat16), (4, 2048, 768, 2048, 20, torch.bfloat16)])
def test_mma_rows_gated(rows, k, n, g, split_k, dtype):
    """SiLU-and-mul in the tensor-core kernel's epilogue (gate|up: the gate the first half of the outputs), K whole
    and split, with and without bias, against the float64 layer: gate and up within their float32 sums and one
    rounding, SiLU rounded, the product rounded (as test_one_row_gemv_gated allows)."""
    from headrace.kernels.int4_mma import int4_mma

    qweight, scales, zeros = _layer(k, n, g, dtype, seed=rows * k + n)
    gen = torch.Generator().manual_seed(k + n + rows)
    x = (torch.randn(rows, k, generator=gen) * 2).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    w = dequantize_int4(qweight, scales, zeros, g, torch.float64)
    half_eps = torch.finfo(dtype).eps / 2
    counts = counters(split_k_tiles(n), DEVICE)
    for b in (None, bias):
        want, allowed = _gated_bound(x.double() @ w.t() + (0 if b is None else b.double()),
                                     (x.double().abs() @ w.abs().t()) * 2**-20, half_eps)
        got = int4_mma(x, qweight, scales, zeros, g, b, counts, split_k, gated=True)
        assert got.shape == (rows, n // 2) and got.dtype == dtype
        err = (got.double() - want).abs()
        assert bool((err <= allowed).all()), f"max error {err.max():.3g}"
        assert not counts.any()


def test_mma_refuses_rows_past_its_width():
    """The tensor-core kernel multiplies at most ROWS rows (its MMA's B width): more, or none, is refused by name
    before anything launches, as are rows it cannot read (float32, a stride not a multiple of 8), K or groups not in
    whole steps, N not in whole tiles, and an R it has no layout for."""
    from headrace.kernels.int4_mma import ROWS, int4_mma

    qweight, scales, zeros = _layer(128, 128, 128, torch.float16, seed=5)
    for rows in (ROWS + 1, 0):
        x = torch.zeros(rows, 128, dtype=torch.float16, device=DEVICE)
        with pytest.raises(ValueError, match=f"int4_mma takes 1 to {ROWS} rows, got {rows}"):
            int4_mma(x, qweight, scales, zeros, 128, None)
    x = torch.zeros(2, 128, dtype=torch.float16, device=DEVICE)
    narrow = [t[:, :64].contiguous() for t in (qweight, scales, zeros)]  # N = 64: one R = 1 tile, half an R = 2 one
    cases = [((x.float(), qweight, scales, zeros, 128, None), {}, "bfloat16 or float16 rows, got torch.float32"),
             ((torch.zeros(2, 130, dtype=torch.float16, device=DEVICE)[:, :128], qweight, scales, zeros, 128, None), {},
              "stride a multiple of 8"),
             ((x[:, :64].contiguous(), qweight[:8], scales, zeros, 64, None), {}, "K = 64, group_size 64"),
             ((x, *narrow, 128, None), {"config": (2, 8)}, "R = 2 takes N in tiles of 128, got N = 64"),
             ((x, qweight, scales, zeros, 128, None), {"config": (4, 4)}, "R .MMA row tiles a warp. is 1 or 2, got 4")]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            int4_mma(*args, **kwargs)
