"""Layer kernels (RMSNorm, q|k|v to rotated q and the KV cache, silu_and_mul) against their torch references,
and the references against executor/models/layers.py, the code the model runs.

Without a GPU the kernels run under the Triton interpreter on the CPU; see
tests/test_triton_kernels.py for why TRITON_INTERPRET is set before imports.

Tolerances (rtol = atol): float32 1e-5 (reduction order, rsqrt and FMA
contraction differ by a few ulp); float16 2e-3 and bfloat16 1e-2, i.e. a
couple of units in the last place (2^-11 and 2^-8 relative): the kernels
round where the torch code rounds, so a difference is a last-bit flip caused
by a float32 difference just before a rounding point.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from headrace.checkpoint.config import RopeConfig  # noqa: E402
from headrace.executor.models import layers  # noqa: E402
from headrace.kernels.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from headrace.kernels.norm import cast_rtne, rms_norm, rms_norm_ref  # noqa: E402
from headrace.kernels.rotary import rotary_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
MAX_POSITIONS = 4096


def _gen(*key: int) -> torch.Generator:
    seed = 0
    for k in key:
        seed = seed * 100_003 + k
    return torch.Generator().manual_seed(seed)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    tol = TOL[want.dtype]
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol)


DTYPES = [torch.float32, torch.bfloat16]


# ---------------------------------------------------------------- cast_rtne


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, cast_rtne(tl.load(x_ptr + offs, mask=mask), out_ptr.dtype.element_ty), mask=mask)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # float16 -> inf, as it should
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cast_rtne_is_torchs_cast(dtype):
    """Every kernel's rounding point: bit for bit torch's float32 -> dtype,
    including ties (to even), carries into the exponent, overflow to inf,
    subnormals, infinities and NaN."""
    g = _gen(0, dtype.itemsize)
    bits = torch.randint(0, 2**31, (20_000,), generator=g, dtype=torch.int64)
    bits[:1000] = (bits[:1000] & ~0xFFFF) | 0x8000  # exact bf16 ties
    bits[1000:2000] |= 0x7FFF  # mantissa tails that round up, carrying
    bits[2000:3000] = (bits[2000:3000] & ~0x7F_FFFF) | 0x7F_FFFF  # all mantissa bits set: carry into the exponent
    bits[3000:3100] = bits[3000:3100] & 0x7F_FFFF  # subnormals
    bits[3100:3200] = 0x7F7F_0000 + bits[3100:3200] % 0x1_0000  # near float32 max: bf16 overflows to inf
    x = torch.where(bits % 2 == 0, bits, bits | (1 << 31)).to(torch.int32).view(torch.float32).clone()
    x[-4:] = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0])
    want = x.to(dtype)
    got = torch.empty_like(want, device=DEVICE)
    _cast_kernel[(triton.cdiv(x.numel(), 1024),)](x.to(DEVICE), got, x.numel(), BLOCK=1024)
    got = got.cpu()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].float().view(torch.int32), want[~nan].float().view(torch.int32))

# ---------------------------------------------------------------- RMSNorm

# (tokens, hidden): powers of two and not (1000, 3072, 100), one row and many,
# up to the 8192 the kernel is sized for.
NORM_SHAPES = [(1, 64), (3, 1000), (257, 64), (17, 3072), (5, 4096), (33, 1000), (2, 8192), (7, 100), (64, 128)]


def _norm_inputs(tokens, hidden, dtype, *key):
    g = _gen(*key)
    # Rows of very different scales: the norm must not depend on it.
    scale = torch.exp(torch.randn(tokens, 1, generator=g) * 2)
    x = (torch.randn(tokens, hidden, generator=g) * scale).to(dtype)
    residual = (torch.randn(tokens, hidden, generator=g) * scale).to(dtype)
    weight = (1 + 0.3 * torch.randn(hidden, generator=g)).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", NORM_SHAPES)
def test_rms_norm(tokens, hidden, dtype, poisoned_empty):
    x, _, weight = _norm_inputs(tokens, hidden, dtype, 1, tokens, hidden)
    want = rms_norm_ref(x, weight, 1e-6)
    x_dev = x.to(DEVICE)
    _close(rms_norm(x_dev, weight.to(DEVICE), 1e-6), want)
    assert torch.equal(x_dev.cpu(), x)  # x is read only


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", NORM_SHAPES)
def test_rms_norm_residual(tokens, hidden, dtype, poisoned_empty):
    x, residual, weight = _norm_inputs(tokens, hidden, dtype, 2, tokens, hidden)
    want_out, want_sum = rms_norm_ref(x, weight, 1e-5, residual)
    x_dev, res_dev = x.to(DEVICE), residual.to(DEVICE)
    got_out, got_sum = rms_norm(x_dev, weight.to(DEVICE), 1e-5, res_dev)
    _close(got_out, want_out)
    # The sum is one rounding of an exact float32 sum in both: bit for bit.
    assert got_sum.dtype == dtype and torch.equal(got_sum.cpu(), want_sum)
    # In place: the sum is written into residual's buffer; x is read only.
    assert got_sum.data_ptr() == res_dev.data_ptr()
    assert torch.equal(x_dev.cpu(), x)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("tokens,hidden", [(3, 1000), (33, 4096)])
def test_rms_norm_float16(tokens, hidden, residual, poisoned_empty):
    x, res, weight = _norm_inputs(tokens, hidden, torch.float16, 3, tokens, hidden)
    res = res if residual else None
    want = rms_norm_ref(x, weight, 1e-6, res)
    got = rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-6, None if res is None else res.clone().to(DEVICE))
    for g, w in zip(got, want) if residual else [(got, want)]:
        _close(g, w)


def test_rms_norm_float32_weight_on_bf16_input(poisoned_empty):
    """A float32 weight (a model not cast) promotes the output, as torch does."""
    x, res, _ = _norm_inputs(9, 1000, torch.bfloat16, 4)
    weight = 1 + 0.3 * torch.randn(1000, generator=_gen(4, 1))
    want, want_sum = rms_norm_ref(x, weight, 1e-6, res)
    got, got_sum = rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-6, res.clone().to(DEVICE))
    assert want.dtype == torch.float32
    _close(got, want)
    assert torch.equal(got_sum.cpu(), want_sum)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(5, 4, 2, 64), (33, 16, 4, 128), (1, 8, 8, 32)])
def test_rms_norm_per_head_strided(tokens, heads, kv_heads, head_dim, dtype, poisoned_empty):
    """Qwen3's q/k norm: [tokens, heads, head_dim] views of a fused qkv tensor."""
    g = _gen(5, tokens, heads, head_dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(DEVICE)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    weight = (1 + 0.3 * torch.randn(head_dim, generator=g)).to(dtype)
    for view in (q, k):
        want = rms_norm_ref(view.cpu(), weight, 1e-6)
        assert want.shape == view.shape
        _close(rms_norm(view, weight.to(DEVICE), 1e-6), want)


def test_rms_norm_empty():
    x = torch.empty(0, 64, device=DEVICE)
    assert rms_norm(x, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (33, 1000), (17, 3072)])
def test_rms_norm_ref_matches_transformers(tokens, hidden, dtype, residual):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x, res, weight = _norm_inputs(tokens, hidden, dtype, 6, tokens, hidden)
    module = LlamaRMSNorm(hidden, 1e-6).to(dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        want = module(x + res if residual else x)
    got = rms_norm_ref(x, weight, 1e-6, res.clone() if residual else None)
    if residual:
        got, total = got
        assert torch.equal(total, x + res)
    assert got.dtype == want.dtype and torch.equal(got, want)


# ---------------------------------------------------------------- rotary

def _cos_sin(head_dim: int) -> torch.Tensor:
    return layers.rope_cos_sin(RopeConfig(theta=10_000.0), head_dim, MAX_POSITIONS)


def _rotary_inputs(tokens, heads, kv_heads, head_dim, dtype, *key):
    g = _gen(*key)
    positions = torch.randint(0, MAX_POSITIONS, (tokens,), generator=g)
    positions[0] = MAX_POSITIONS - 1  # the table's last row
    if tokens > 1:
        positions[1] = 0  # the identity rotation
    q = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g).to(dtype)
    return positions, q, k


@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(3, 4, 2, 64), (33, 16, 4, 128), (9, 8, 1, 32)])
def test_rotary_ref_matches_transformers(tokens, heads, kv_heads, head_dim):
    """transformers' apply_rotary_pos_emb on its own cos/sin layout (both halves repeated)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    positions, q, k = _rotary_inputs(tokens, heads, kv_heads, head_dim, torch.float32, 9, tokens, heads, head_dim)
    cos_sin = layers.rope_cos_sin(RopeConfig(theta=500_000.0, type="llama3", factor=8.0), head_dim, MAX_POSITIONS)
    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)  # [tokens, head_dim]
    # transformers' layout: [batch, heads, tokens, head_dim]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    got_q, got_k = rotary_ref(positions, q, k, cos_sin)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- silu_and_mul

# (tokens, d): d = intermediate size; 1000 and 3072 are not powers of two,
# 1024 exactly the kernel's block, 4097 four blocks and a 1-wide tail.
ACT_SHAPES = [(1, 64), (3, 1000), (257, 64), (17, 3072), (5, 4096), (33, 1000), (2, 4097), (64, 1024)]


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's numpy exp
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("tokens,d", ACT_SHAPES)
def test_silu_and_mul(tokens, d, dtype, poisoned_empty):
    g = _gen(10, tokens, d)
    x = (torch.randn(tokens, 2 * d, generator=g) * 4).to(dtype)  # deep into both tails of silu
    if dtype == torch.float32:
        x[0, :2] = torch.tensor([-100.0, 100.0])  # exp overflows: silu -> -0 and x
    want = silu_and_mul_ref(x)
    _close(silu_and_mul(x.to(DEVICE)), want)


def test_silu_and_mul_strided_rows(poisoned_empty):
    """Rows of a wider buffer (a slice of a larger projection output)."""
    g = _gen(11)
    buf = torch.randn(13, 2 * 1000 + 37, generator=g)
    x = buf[:, : 2 * 1000]
    x_dev = buf.to(DEVICE)[:, : 2 * 1000]
    assert not x_dev.is_contiguous()
    _close(silu_and_mul(x_dev), silu_and_mul_ref(x))


def test_silu_and_mul_empty():
    assert silu_and_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16])
@pytest.mark.parametrize("tokens,d", [(1, 64), (33, 1000), (17, 3072)])
def test_silu_and_mul_ref_matches_transformers(tokens, d, dtype):
    from transformers.activations import ACT2FN

    x = (torch.randn(tokens, 2 * d, generator=_gen(12, tokens, d)) * 4).to(dtype)
    want = ACT2FN["silu"](x[:, :d]) * x[:, d:]
    got = silu_and_mul_ref(x)
    assert got.dtype == want.dtype and torch.equal(got, want)


# ---------------------------------------------------------------- q|k|v -> q, and k, v into the cache

# (tokens, heads, kv_heads, head_dim, block_size): GQA, MQA, MHA, a half head_dim that is not a
# power of two, more heads than one tile holds (128 x 32 halves of 64 = 2 tiles at _TILE 2048).
QKV_SHAPES = [(1, 4, 2, 64, 16), (5, 8, 1, 32, 4), (33, 16, 4, 128, 16), (9, 6, 2, 80, 8), (3, 64, 8, 128, 32)]


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim,block_size", QKV_SHAPES)
def test_rope_and_cache(tokens, heads, kv_heads, head_dim, block_size, dtype, norm):
    """One launch for the decoder's steps between the qkv projection and attention,
    against their references in turn: q normed (Qwen3) and rotated; k the same and
    v stored at the tokens' slots, a padding token (slot -1) storing nothing, and
    every other cache slot left as it was (NaN)."""
    from headrace.kernels.qkv import rope_and_cache, rope_and_cache_ref

    g = _gen(11, tokens, heads + head_dim, int(norm))
    positions = torch.randint(0, MAX_POSITIONS, (tokens,), generator=g)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 2).to(dtype)
    weights = [(torch.rand(head_dim, generator=g) + 0.5).to(dtype) for _ in range(2)] if norm else [None, None]
    num_blocks = -(-2 * tokens // block_size) + 1
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[tokens // 2] = -1
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    cos_sin = _cos_sin(head_dim)
    want_cache = cache.clone()
    want_q = rope_and_cache_ref(qkv, positions, cos_sin, *weights, 1e-6, want_cache, slots, heads)
    got_cache = cache.to(DEVICE)
    dev = [None if w is None else w.to(DEVICE) for w in weights]
    got_q = rope_and_cache(qkv.to(DEVICE), positions.to(DEVICE), cos_sin.to(DEVICE), *dev, 1e-6, got_cache,
                           slots.to(DEVICE), heads)
    _close(got_q, want_q)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat_got, flat_want = got_cache.cpu().view(2, -1, kv_heads, head_dim), want_cache.view(2, -1, kv_heads, head_dim)
    _close(flat_got[:, written], flat_want[:, written])
    assert flat_got[:, ~written].isnan().all()


def test_rope_and_cache_ref_is_the_models_steps():
    """The reference, against the model's steps in turn (its RMSNorm layers per head,
    rotary_ref on its rope_cos_sin table, write_kv_ref): the same values, bit for bit."""
    from headrace.kernels.attention import write_kv_ref
    from headrace.kernels.qkv import rope_and_cache_ref

    tokens, heads, kv_heads, head_dim = 7, 8, 2, 64
    g = _gen(12)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).bfloat16()
    positions = torch.randint(0, MAX_POSITIONS, (tokens,), generator=g)
    q_norm, k_norm = layers.RMSNorm(head_dim, 1e-6), layers.RMSNorm(head_dim, 1e-6)
    for n in (q_norm, k_norm):
        n.weight.data = (torch.rand(head_dim, generator=g) + 0.5).bfloat16()
    cos_sin = layers.rope_cos_sin(RopeConfig(theta=10_000.0), head_dim, MAX_POSITIONS)
    slots = torch.arange(tokens) * 3
    cache, want_cache = (torch.zeros(2, 2, 16, kv_heads, head_dim, dtype=torch.bfloat16) for _ in range(2))
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    want_q, want_k = rotary_ref(positions, q_norm(q.reshape(tokens, heads, head_dim)),
                                k_norm(k.reshape(tokens, kv_heads, head_dim)), cos_sin)
    write_kv_ref(want_k, v.reshape(tokens, kv_heads, head_dim), want_cache, slots)
    got_q = rope_and_cache_ref(qkv, positions, cos_sin, q_norm.weight, k_norm.weight, 1e-6, cache, slots, heads)
    assert torch.equal(got_q, want_q) and torch.equal(cache, want_cache)


def test_rope_and_cache_empty():
    from headrace.kernels.qkv import rope_and_cache

    cache = torch.zeros(2, 1, 16, 2, 64, device=DEVICE)
    none = torch.empty(0, dtype=torch.int64, device=DEVICE)
    q = rope_and_cache(torch.empty(0, 8 * 64, device=DEVICE), none, _cos_sin(64).to(DEVICE), None, None, 1e-6, cache,
                       none, 4)
    assert q.shape == (0, 4, 64) and not cache.any()
