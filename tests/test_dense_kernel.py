"""The few-row float projection kernel (kernels/dense.py) against its torch reference, and the
reference against the model's own steps (RMSNorm, nn.Linear, SiLU-and-multiply).

Without a GPU the kernel runs under the Triton interpreter, whose tl.dot mishandles
bfloat16: there the 16-bit dtype is float16, on a GPU both are tested. Tolerances are
those of tests/test_layer_kernels.py: the kernel rounds where the model's steps round,
so a 16-bit difference is a last-bit flip from a float32 sum taken in another order.
"""
from __future__ import annotations

import pytest
import torch

from headrace.executor.models.layers import RMSNorm, silu_and_mul
from headrace.kernels import dense
from headrace.kernels.dense import dense_linear, dense_linear_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
HALF = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
SPLIT = (8, 64, 4, 1)  # a small K block, so that K = 256 is split in four
DOT_SPLIT = (16, 64, 4, 1)


def _inputs(m, n_rows, k, dtype, seed, bias):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n_rows, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n_rows, generator=g).to(dtype) if bias else None
    res = torch.randn(m, k, generator=g).to(dtype)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    return x, w, b, res, nw


def _run(m, n_rows, k, dtype, norm, residual, gated, bias, config, seed=0):
    x, w, b, res, nw = _inputs(m, n_rows, k, dtype, seed, bias)
    norm_arg = (nw, 1e-6) if norm else None
    res_arg = res if residual else None
    want, want_res = dense_linear_ref(x, w, b, norm_arg, res_arg, gated)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    got, got_res = dense_linear(dev(x), dev(w), dev(b), None if not norm else (dev(nw), 1e-6), dev(res_arg),
                                gated, config=config)
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = TOL[dtype]
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)
    if norm:  # the next residual is x + residual exactly, or x itself
        assert torch.equal(got_res.cpu(), want_res)
    else:
        assert got_res is None
    if residual:
        torch.testing.assert_close(dev(res_arg).cpu(), res)  # the caller's residual is left as it was


@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("norm,residual,gated", [(False, False, False), (True, False, False), (True, True, False),
                                                 (True, True, True), (False, False, True)])
@pytest.mark.parametrize("dtype", HALF)
def test_dense_linear_16bit(m, norm, residual, gated, dtype, poisoned_empty):
    _run(m, 96, 256, dtype, norm, residual, gated, bias=m == 3,
         config=(SPLIT if m == 1 else DOT_SPLIT) if norm else None)


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("gated", [False, True])
def test_dense_linear_float32_split_and_ragged(m, gated, poisoned_empty):
    """float32 (tl.dot in IEEE precision); K not a multiple of the block, rows not of the tile."""
    _run(m, 2 * 21, 200, torch.float32, True, True, gated, bias=True,
         config=SPLIT if m == 1 else DOT_SPLIT)


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("k", [256, 200])
def test_dense_linear_weights_read_before_the_wait(m, k, poisoned_empty):
    """A narrow weight (96 rows) taken whole-K in one slice at one or two rows (dense.EARLY_ROWS): its weights
    are read before the PDL wait, K a multiple of the slice or ragged, gated or not."""
    for gated in (False, True):
        _run(m, 96, k, torch.float16, False, False, gated, bias=m == 2 and not gated, config=None)


@pytest.mark.parametrize("m", [1, 3])
def test_dense_linear_several_slices_a_program(m, poisoned_empty):
    """Enough weight rows that K is not split: each program walks all four 64-wide slices of K itself."""
    _run(m, 2176, 256, torch.float16, True, True, False, bias=False, config=SPLIT if m == 1 else DOT_SPLIT)


def test_dense_linear_few_rows_several_slices(poisoned_empty):
    """A few rows on a narrow weight whose K takes several slices (past dense._ROW_K in a model: a 1536 x 8960 down
    projection at 2 to 4 rows): each row's per-lane sums carried from slice to slice, the last slice ragged."""
    _run(2, 531, 136, torch.float16, False, False, False, bias=True, config=(2, 64, 4, 1))  # 266 tiles: K not split


@pytest.mark.parametrize("n_rows,k,gated", [(96, 200, True), (2200, 256, False), (2200, 256, True)])
def test_dense_linear_one_row_configs_in_use(n_rows, k, gated, poisoned_empty):
    """One row at the configs dense_linear picks itself (dense.row_config): a narrow weight 8 rows a program, a
    wide one with a short K 8 rows a program and 16 gated, rows not a multiple of the tile, norm and residual in."""
    _run(1, n_rows, k, torch.float16, True, True, gated, bias=not gated, config=None)


@pytest.mark.parametrize("norm,gated", [(False, False), (True, True)])
def test_dense_linear_one_row_wide_and_long(norm, gated, poisoned_empty, monkeypatch):
    """One row on a wide weight with K past 1024 (Qwen3-8B's projections), at the configs row_config picks: plain
    (o, down) one weight row a program, K whole in one slice (up to 4096: here 2048 wide, ragged); gated with the norm
    in (gate|up; q|k|v, normed, takes the same) 16 rows a program over 512-wide slices, the last ragged. "Wide" is
    past PLAIN_N rows, lowered here so that 72 rows (not a multiple of 16) count, which keeps the interpreter's
    programs few."""
    monkeypatch.setattr(dense, "PLAIN_N", 64)
    assert dense.row_config(72, 1100, gated, normed=norm)[0] == (16 if norm else 1)
    _run(1, 72, 1100, torch.float16, norm, norm, gated, bias=not gated, config=None)


def test_dense_linear_many_rows_refused():
    x = torch.zeros(33, 64, device=DEVICE)
    with pytest.raises(ValueError, match="1 to 32 rows"):
        dense_linear(x, torch.zeros(16, 64, device=DEVICE), None)


@pytest.mark.parametrize("residual", [False, True])
def test_dense_linear_ref_is_the_models_steps(residual):
    """The reference against RMSNorm, nn.Linear and silu_and_mul, the modules the model runs."""
    x, w, b, res, nw = _inputs(4, 64, 48, torch.float32, 7, True)
    norm = RMSNorm(48, 1e-6)
    norm.weight.data.copy_(nw)
    linear = torch.nn.Linear(48, 64)
    linear.weight.data.copy_(w)
    linear.bias.data.copy_(b)
    with torch.no_grad():
        h, want_res = norm(x, res.clone()) if residual else (norm(x), x)
        want = silu_and_mul(linear(h))
        got, got_res = dense_linear_ref(x, w, b, (nw, 1e-6), res if residual else None, gated=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)
