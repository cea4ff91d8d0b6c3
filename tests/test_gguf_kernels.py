"""GGUF weights kept packed (kernels/gguf.py) against the numpy dequantizer and the torch reference.

Without a GPU the Triton kernels run under the interpreter on the CPU. Triton
reads TRITON_INTERPRET when a kernel is decorated (at import of
headrace.kernels), so it is set here before any headrace or triton import.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from headrace.checkpoint.gguf_quants import GGML_TYPES, dequantize  # noqa: E402
from headrace.kernels.gguf import (  # noqa: E402
    DEQUANTIZE_ROWS, FORMATS, _Config, _launch, dequantize_gguf, dequantize_gguf_triton, gguf_linear, gguf_linear_ref,
    pack_gguf, packed_nbytes,
)
from headrace.kernels.splitk import counters  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TYPE_IDS = {name: type_id for type_id, name in GGML_TYPES.items() if name in FORMATS}
F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [208]}  # byte offsets in a block
# (N, K) per format family: K = 96 and 576 (SmolLM2's hidden size) are not multiples of 256, as
# real files store such rows in 32-blocks; the K-quants take K = 256 and 512. N leaves partial row tiles.
SHAPES = {32: [(24, 96), (40, 576)], 256: [(24, 256), (40, 512)]}
if DEVICE == "cuda":
    SHAPES = {32: [(200, 576), (1000, 1536)], 256: [(200, 512), (1000, 4096)]}
M_VALUES = [0, 1, 5, 16, 40]


def random_raw(name: str, n: int, k: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    """Random blocks uint8 [n, row bytes]: random quantized bytes, finite float16 scales in [-scale, scale]."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * k // fmt.block, fmt.size), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        raw[:, off:off + 2] = rng.uniform(-scale, scale, size=(raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(n, k // fmt.block * fmt.size))


def _weight(name: str, n: int, k: int, seed: int):
    # Scales up to 2^-7 keep W moderate (|W| < 32 even in Q6_K): y stays well inside float16's range.
    raw = random_raw(name, n, k, seed, scale=2.0 ** -7)
    return raw, pack_gguf(name, raw.to(DEVICE), (n, k))


def _assert_close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias) -> None:
    """Within a few roundings of the dtype, relative to sum |x| |W| + |bias| (the size of what was
    added, so cancellation does not make the test flaky): float32 differs from the reference in
    summation order; float16/bfloat16 also in where W is rounded and the output rounding."""
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = x.float().abs() @ w.float().abs().t()
    if bias is not None:
        scale = scale + bias.float().abs()
    tol = 1e-5 if x.dtype == torch.float32 else 2 * torch.finfo(x.dtype).eps
    err = (got.float() - want.float()).abs()
    assert torch.all(err <= tol * scale + 1e-30), f"max error / scale {(err / scale.clamp(min=1e-30)).max():.3g}"


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("rows", [0, 3, 5])
def test_dequantize_matches_numpy(name, rows):
    """dequantize_gguf(pack_gguf(raw)) equals checkpoint/gguf_quants' numpy dequantizer bit for bit."""
    for k in ([32, 96, 512] if FORMATS[name].block == 32 else [256, 512]):
        raw = random_raw(name, rows, k, seed=rows * 1000 + k)
        want = torch.from_numpy(dequantize(raw.numpy(), TYPE_IDS[name], (rows, k)))
        p = pack_gguf(name, raw.to(DEVICE), (rows, k))
        got = dequantize_gguf(p, torch.float32)
        assert got.dtype == torch.float32 and got.shape == (rows, k)
        assert torch.equal(got.cpu(), want)
        assert torch.equal(dequantize_gguf(p, torch.bfloat16).cpu(), want.to(torch.bfloat16))


@pytest.mark.parametrize("name", list(FORMATS))
def test_packed_layout_keeps_the_file_size(name):
    n, k = 6, 512
    raw = random_raw(name, n, k, seed=1)
    p = pack_gguf(name, raw, (n, k))
    extra = 2 * n * k // 256 if name == "Q6_K" else 0  # Q6_K's d is float32
    assert packed_nbytes(p) == raw.numel() + extra
    assert p.shape == (n, k) and p.type_name == name
    assert p.qs.shape == ((n, k) if name == "Q8_0" else (n, k // 2))
    assert p.d.dtype == (torch.float32 if name == "Q6_K" else torch.float16)
    assert all(t.is_contiguous() for t in p.tensors())
    moved = p.to(DEVICE)
    assert torch.equal(dequantize_gguf(moved).cpu(), dequantize_gguf(p))


@pytest.mark.parametrize("name", list(FORMATS))
def test_dequantize_triton_matches_reference(name):
    """The Triton dequantization (gguf_linear's path for many rows) equals dequantize_gguf bit for bit.
    The shapes leave partial row tiles, and in the 32-block formats a partial K tile (K = 96, 576);
    the K-quants' K is a multiple of the kernel's K tile (256 columns). The interpreter casts float32
    to bfloat16 by truncation (a GPU rounds to nearest even, as torch does), so bfloat16 is GPU-only."""
    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
    for i, (n, k) in enumerate(SHAPES[FORMATS[name].block] + [(0, FORMATS[name].block)]):
        _, p = _weight(name, n, k, seed=20 + i)
        for dtype in dtypes:
            got = dequantize_gguf_triton(p, dtype)
            assert got.dtype == dtype and got.shape == (n, k)
            assert torch.equal(got, dequantize_gguf(p, dtype))


@pytest.mark.skipif(DEVICE != "cuda", reason="gguf_linear dequantizes for cuBLAS only on a GPU")
@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_many_rows(name, dtype):
    n, k = SHAPES[FORMATS[name].block][1]
    _, p = _weight(name, n, k, seed=9)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, DEQUANTIZE_ROWS // 2 + 3, k, generator=g).to(DEVICE, dtype)
    bias = torch.randn(n, generator=g).to(DEVICE, dtype)
    got = gguf_linear(x, p, bias)
    _assert_close(got.reshape(-1, n), gguf_linear_ref(x, p, bias).reshape(-1, n), x.reshape(-1, k),
                  dequantize_gguf(p), bias)


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("shape_idx", [0, 1])
def test_linear_float32(name, m, shape_idx):
    n, k = SHAPES[FORMATS[name].block][shape_idx]
    raw, p = _weight(name, n, k, seed=shape_idx)
    g = torch.Generator().manual_seed(m * 10 + shape_idx)
    x = torch.randn(m, k, generator=g).to(DEVICE)
    bias = torch.randn(n, generator=g).to(DEVICE) if shape_idx else None
    got = gguf_linear(x, p, bias)
    _assert_close(got, gguf_linear_ref(x, p, bias), x, dequantize_gguf(p), bias)


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 16, 40])
def test_linear_half(name, dtype, m):
    if DEVICE == "cpu" and dtype == torch.bfloat16 and m > 1:
        pytest.skip("the Triton interpreter's tl.dot misreads bfloat16 operands")
    n, k = SHAPES[FORMATS[name].block][1]
    raw, p = _weight(name, n, k, seed=7)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    bias = torch.randn(n, generator=g).to(DEVICE, dtype)
    got = gguf_linear(x, p, bias)
    _assert_close(got, gguf_linear_ref(x, p, bias), x, dequantize_gguf(p), bias)


# Configs that force what the default ones may not reach on these shapes: K split into
# runs whose last step is partial, a single program over all of K, tiny tiles.
FORCED = [_Config(True, 4, 1, 8, 4, 1), _Config(True, 8, 1, 8, 2, 1, 3), _Config(True, 8, 1, 64, 2, 1, 1),
          _Config(True, 4, 1, 16, 4, 1, 2, False), _Config(False, 16, 16, 4, 4, 2), _Config(False, 32, 16, 2, 4, 2, 1)]


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("cfg", FORCED, ids=lambda c: f"{'gemv' if c.gemv else 'mm'}-{c.block_n}-{c.units}-{c.split_k}"
                                                      f"{'' if c.x_once else '-xb'}")
def test_linear_forced_configs(name, cfg):
    n, k = SHAPES[FORMATS[name].block][1]
    raw, p = _weight(name, n, k, seed=3)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, k, generator=g).to(DEVICE)
    bias = torch.randn(n, generator=g).to(DEVICE)
    counts = counters(n * 2, DEVICE)  # room for the tiles of either row of x
    got = _launch(x, p, bias, cfg, counts)
    _assert_close(got, gguf_linear_ref(x, p, bias), x, dequantize_gguf(p), bias)
    assert not counts.any()  # the split-K counters are back at zero


@pytest.mark.parametrize("m", [1, 16])
def test_linear_leading_dims_and_reproducible(m):
    n, k = SHAPES[256][0]
    raw, p = _weight("Q4_K", n, k, seed=11)
    x = torch.randn(2, m, k, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    got = gguf_linear(x, p, None)
    assert got.shape == (2, m, n)
    assert torch.equal(got, gguf_linear(x, p, None))
    assert torch.equal(got.reshape(-1, n), gguf_linear(x.reshape(-1, k), p, None))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("m", [1, 16, 300, DEQUANTIZE_ROWS])
def test_linear_in_cuda_graph(m):
    n, k = SHAPES[256][1]
    raw, p = _weight("Q6_K", n, k, seed=2)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    bias = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    want = gguf_linear(x, p, bias)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gguf_linear(x, p, bias)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gguf_linear(x, p, bias))
    assert not torch.equal(out, want)


def test_bad_input():
    raw = random_raw("Q4_0", 4, 64, seed=0)
    with pytest.raises(ValueError, match="Q4_0 weight of shape \\(4, 64\\) needs 4 x 36 uint8 bytes"):
        pack_gguf("Q4_0", raw[:, :-2], (4, 64))
    with pytest.raises(ValueError, match="needs 4 x 36 uint8 bytes, got torch.int8"):
        pack_gguf("Q4_0", raw.view(torch.int8), (4, 64))
    with pytest.raises(ValueError, match="GGUF type 'Q5_K' has no packed kernel; supported: Q8_0"):
        pack_gguf("Q5_K", raw, (4, 64))
    with pytest.raises(ValueError, match="Q4_K needs K \\(the row length\\) a multiple of 256, got K = 576"):
        pack_gguf("Q4_K", torch.zeros(1, 576 // 256 * 144 + 144, dtype=torch.uint8), (1, 576))
    with pytest.raises(ValueError, match="Q8_0 needs K \\(the row length\\) a multiple of 32, got K = 40"):
        pack_gguf("Q8_0", torch.zeros(2, 34, dtype=torch.uint8), (2, 40))
    with pytest.raises(ValueError, match="shape must be \\(N, K\\)"):
        pack_gguf("Q8_0", torch.zeros(2, 34, dtype=torch.uint8), (2, 32, 1))
    p = pack_gguf("Q4_0", raw, (4, 64))
    with pytest.raises(ValueError, match="x must be \\[..., K\\] with K = 64"):
        gguf_linear_ref(torch.zeros(2, 32), p, None)
    with pytest.raises(ValueError, match="bias must be \\[N\\] = \\[4\\]"):
        gguf_linear(torch.zeros(2, 64), p, torch.zeros(5))
    with pytest.raises(ValueError, match="x must be float16, bfloat16 or float32, contiguous"):
        gguf_linear(torch.zeros(64, 2).t(), p, None)
    with pytest.raises(ValueError, match="x must be float16, bfloat16 or float32"):
        gguf_linear(torch.zeros(2, 64, dtype=torch.int32), p, None)
    if DEVICE == "cuda":
        with pytest.raises(ValueError, match="the weight is on cpu and x on cuda"):
            gguf_linear(torch.zeros(2, 64, device=DEVICE), p, None)
