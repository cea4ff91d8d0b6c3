"""Triton paged attention and KV-cache write against their torch references,
and the attention reference against dense float64 attention.

Without a GPU the kernels run under the Triton interpreter, which Triton reads
when a kernel is decorated: it is set here before any headrace or triton
import (tests/conftest.py sets it too, and imports headrace first).
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.test_kernels import dense_causal_attention  # noqa: E402
from headrace.kernels.attention import (  # noqa: E402
    paged_attention, paged_attention_ref, paged_attention_torch,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (cached tokens, new query tokens) per request. MIXED has decode rows (n = 1)
# with short and long contexts, fresh prefills (cached = 0), chunks over a
# cached prefix, a request with no query this step, and a prefill longer than
# one query tile. DECODE is what a decode-only step looks like.
MIXED = [(0, 5), (9, 1), (130, 7), (0, 1), (0, 0), (250, 1), (16, 40), (0, 70), (63, 2)]
DECODE = [(299, 1), (0, 1), (76, 1), (0, 0), (150, 1), (64, 1)]

# (block_size, (num_heads, num_kv_heads), head_dim, dtype): every block size,
# head layout and head dim appears with both dtypes somewhere.
CASES = [
    (1, (4, 4), 32, torch.float32),
    (4, (8, 2), 64, torch.float32),
    (16, (8, 1), 128, torch.float32),
    (16, (16, 8), 32, torch.float32),
    (4, (4, 4), 128, torch.bfloat16),
    (16, (8, 2), 32, torch.bfloat16),
    (1, (8, 1), 64, torch.bfloat16),
    (4, (16, 8), 64, torch.bfloat16),
]


def _tol(dtype: torch.dtype) -> dict:
    return dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty and torch.empty_like return NaN-filled floats (and -77 for
    integers), so anything a launcher leaves unwritten fails the comparison."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        t.fill_(float("nan") if t.dtype.is_floating_point else -77)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))


def _batch(reqs, block_size, num_heads, num_kv_heads, head_dim, dtype, seed):
    """A cache holding every request's keys (blocks scattered through the pool),
    the step's queries, and the full per-request keys and values for the dense check."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-(c + n) // block_size) for c, n in reqs) + 1  # a spare column: tables are padded
    num_blocks = len(reqs) * max_blocks + 3
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = perm[: len(reqs) * max_blocks].view(len(reqs), max_blocks).int()
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    qs, qsl, seq_lens, full = [], [0], [], []
    for i, (cached, n) in enumerate(reqs):
        L = cached + n
        pos = torch.arange(L)
        slots = block_tables[i].long()[pos // block_size] * block_size + pos % block_size
        k_all = torch.randn(L, num_kv_heads, head_dim, generator=g).to(dtype)
        v_all = torch.randn(L, num_kv_heads, head_dim, generator=g).to(dtype)
        flat[0, slots], flat[1, slots] = k_all, v_all
        qs.append(torch.randn(n, num_heads, head_dim, generator=g).to(dtype))
        qsl.append(qsl[-1] + n)
        seq_lens.append(L)
        full.append((k_all, v_all))
    return torch.cat(qs), kv_cache, qsl, seq_lens, block_tables, full


def _run(q, kv_cache, qsl, seq_lens, block_tables, scale, max_query_len, max_seq_len, **kw):
    def dev(x):
        return torch.tensor(x, dtype=torch.int32, device=DEVICE)

    out = paged_attention(q.to(DEVICE), kv_cache.to(DEVICE), dev(qsl), dev(seq_lens), block_tables.to(DEVICE), scale,
                          max_query_len, max_seq_len, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    return out.cpu()


@pytest.mark.parametrize("block_size,heads,head_dim,dtype", CASES)
def test_paged_attention_mixed(poisoned, block_size, heads, head_dim, dtype):
    num_heads, num_kv_heads = heads
    q, kv_cache, qsl, seq_lens, block_tables, full = _batch(
        MIXED, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=block_size * 1000 + num_heads * 10 + head_dim)
    scale = head_dim**-0.5
    ref = paged_attention_ref(q, kv_cache, qsl, seq_lens, block_tables, scale)
    for i, (k_all, v_all) in enumerate(full):  # the reference itself, against dense float64 attention
        dense = dense_causal_attention(q[qsl[i] : qsl[i + 1]], k_all, v_all, scale)
        torch.testing.assert_close(ref[qsl[i] : qsl[i + 1]].double(), dense, **_tol(dtype))
    max_query_len = max(n for _, n in MIXED)
    # Decode rows in the decode kernel and the rest in the general one; the
    # same with looser bounds (they pick other tiles, not other results) and
    # split-K; then every row through the general kernel.
    for bounds, kw in [((max_query_len, max(seq_lens)), {}),
                       ((max_query_len + 50, max(seq_lens) + 100), dict(num_splits=3)),
                       ((max_query_len, max(seq_lens)), dict(use_decode_kernel=False))]:
        out = _run(q, kv_cache, qsl, seq_lens, block_tables, scale, *bounds, **kw)
        torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype), msg=lambda m: f"{kw}: {m}")


@pytest.mark.parametrize("block_size,heads,head_dim,dtype", CASES)
def test_paged_attention_decode(poisoned, block_size, heads, head_dim, dtype):
    num_heads, num_kv_heads = heads
    q, kv_cache, qsl, seq_lens, block_tables, _ = _batch(
        DECODE, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=block_size * 999 + num_heads * 7 + head_dim)
    scale = head_dim**-0.5
    ref = paged_attention_ref(q, kv_cache, qsl, seq_lens, block_tables, scale)
    # The decode kernel alone (max_query_len 1): the picked split count (one
    # 64-key tile a split here), 1 and 3 splits, 32 (the most, leaving some
    # empty: at most 5 key tiles); then the general kernel on the same rows.
    for kw in [{}, dict(num_splits=1), dict(num_splits=3), dict(num_splits=32), dict(use_decode_kernel=False)]:
        out = _run(q, kv_cache, qsl, seq_lens, block_tables, scale, 1, max(seq_lens), **kw)
        torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype), msg=lambda m: f"{kw}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_wide_heads_big_blocks(poisoned, dtype):
    """head_dim 256 (the narrower key tile) and 128-token blocks, both paths."""
    reqs = [(0, 3), (140, 1), (20, 17), (0, 1)]
    q, kv_cache, qsl, seq_lens, block_tables, _ = _batch(reqs, 128, 4, 2, 256, dtype, seed=256)
    ref = paged_attention_ref(q, kv_cache, qsl, seq_lens, block_tables, 0.0625)
    out = _run(q, kv_cache, qsl, seq_lens, block_tables, 0.0625, 17, 141)
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))
    # A decode step of requests 1 and 3 alone; requests 0 and 2 have no query.
    out = _run(q[[3, 21]], kv_cache, [0, 0, 1, 1, 2], seq_lens, block_tables, 0.0625, 1, 141, num_splits=2)
    want = paged_attention_ref(q[[3, 21]], kv_cache, [0, 0, 1, 1, 2], seq_lens, block_tables, 0.0625)
    torch.testing.assert_close(out.float(), want.float(), **_tol(dtype))


def test_paged_attention_split_is_chosen_for_long_contexts():
    from headrace.kernels.attention import _decode_num_splits

    cpu = torch.device("cpu")
    assert _decode_num_splits(cpu, 1, 8, 60) == 1  # one key tile
    assert _decode_num_splits(cpu, 1, 8, 1152) == 18  # by length: 64 keys a split
    assert _decode_num_splits(cpu, 1, 8, 8192) == 32  # the most
    assert _decode_num_splits(cpu, 8, 8, 8192) == 7  # by occupancy: 3 programs on each of 132 SMs
    assert _decode_num_splits(cpu, 64, 8, 8192) == 1


def test_paged_attention_torch_adapter():
    q, kv_cache, qsl, seq_lens, block_tables, _ = _batch(MIXED[:4], 4, 8, 2, 32, torch.float32, seed=5)
    i32 = dict(dtype=torch.int32)
    out = paged_attention_torch(q, kv_cache, torch.tensor(qsl, **i32), torch.tensor(seq_lens, **i32), block_tables,
                                0.3, 7, max(seq_lens))
    torch.testing.assert_close(out, paged_attention_ref(q, kv_cache, qsl, seq_lens, block_tables, 0.3), rtol=0, atol=0)
