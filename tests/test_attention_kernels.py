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
    # empty: at most 5 key tiles; 8 where there are more than 2 KV heads, whose
    # 32 splits cost the interpreter most); block ids read a tile ahead at 1 and 3
    # splits (several tiles a program; empty splits), as the launcher itself
    # reads them where the 6 requests have 1 or 2 KV heads; the requests taken
    # longest first, as the engine orders them (with one split in half the
    # cases, the picked count in the others); then the general kernel on the
    # same rows.
    longest = torch.tensor(sorted(range(len(seq_lens)), key=lambda r: -seq_lens[r]), dtype=torch.int32, device=DEVICE)
    ordered = dict(order=longest, num_splits=1 if num_kv_heads > 2 else None)
    most = dict(num_splits=32 if num_kv_heads <= 2 else 8)
    for kw in [{}, dict(num_splits=1), dict(num_splits=3), most, dict(num_splits=1, ids_ahead=True),
               dict(num_splits=3, ids_ahead=True), ordered, dict(use_decode_kernel=False)]:
        out = _run(q, kv_cache, qsl, seq_lens, block_tables, scale, 1, max(seq_lens), **kw)
        torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype), msg=lambda m: f"{kw}: {m}")


def test_paged_attention_reads_a_cache_by_its_strides(poisoned):
    """The kernels address the cache by its strides alone: the same values held with each block's KV heads
    outermost (benchmarks/decode_attention.py --layout hnd) give the same output, through the decode
    kernel (one and three splits) and the general one."""
    q, kv_cache, qsl, seq_lens, block_tables, _ = _batch(MIXED, 16, 4, 2, 64, torch.float32, seed=5)
    hnd = kv_cache.transpose(2, 3).contiguous().transpose(2, 3)
    assert torch.equal(hnd, kv_cache) and hnd.stride(3) == 16 * 64
    ref = paged_attention_ref(q, kv_cache, qsl, seq_lens, block_tables, 0.125)
    for kw in [{}, dict(num_splits=3), dict(use_decode_kernel=False)]:
        out = _run(q, hnd, qsl, seq_lens, block_tables, 0.125, max(n for _, n in MIXED), max(seq_lens), **kw)
        torch.testing.assert_close(out.float(), ref.float(), **_tol(torch.float32), msg=lambda m: f"{kw}: {m}")


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


@pytest.mark.parametrize("config", [(64, 32, 4, 2), (128, 128, 8, 2), (16, 16, 4, 3)])
def test_prefill_kernel_under_other_tiles(poisoned, config):
    """The general kernel under other (BLOCK_M, BLOCK_N, warps, stages) than it picks (benchmarks sweep
    them): query blocks that start past whole key tiles (visited without masks) and ones that do not,
    chunks over cached prefixes, a block size that does not divide the key tile."""
    from headrace.kernels.attention import launch_prefill

    reqs = [(0, 70), (130, 7), (16, 40), (90, 33), (0, 1)]
    q, kv_cache, qsl, seq_lens, block_tables, _ = _batch(reqs, 4, 8, 2, 32, torch.bfloat16, seed=sum(config))
    ref = paged_attention_ref(q, kv_cache, qsl, seq_lens, block_tables, 0.2)

    def dev(x):
        return torch.tensor(x, dtype=torch.int32, device=DEVICE)

    out = torch.full_like(q, float("nan")).to(DEVICE)
    launch_prefill(q.to(DEVICE), out, kv_cache.to(DEVICE), dev(qsl), dev(seq_lens), block_tables.to(DEVICE), 0.2,
                   70, skip_single=False, config=config)
    torch.testing.assert_close(out.cpu().float(), ref.float(), **_tol(torch.bfloat16))


@pytest.mark.parametrize("config", [(2, 2, 32), (8, 4, 128), (4, 1, 16)])
def test_decode_kernel_under_other_launches(poisoned, config):
    """The decode kernel under other (warps, stages, BLOCK_N) than decode_config's (benchmarks compare them),
    key tiles larger and smaller than a block, with and without split-K and in the engine's order."""
    q, kv_cache, qsl, seq_lens, block_tables, _ = _batch(DECODE, 16, 8, 2, 64, torch.bfloat16, seed=sum(config))
    ref = paged_attention_ref(q, kv_cache, qsl, seq_lens, block_tables, 0.125)
    longest = torch.tensor(sorted(range(len(seq_lens)), key=lambda r: -seq_lens[r]), dtype=torch.int32, device=DEVICE)
    for kw in [dict(num_splits=1), dict(num_splits=3), dict(order=longest)]:
        out = _run(q, kv_cache, qsl, seq_lens, block_tables, 0.125, 1, max(seq_lens), decode_launch=config, **kw)
        torch.testing.assert_close(out.float(), ref.float(), **_tol(torch.bfloat16), msg=lambda m: f"{kw}: {m}")


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


@pytest.mark.parametrize("block_size,heads,head_dim,dtype,norm", [(*c, i % 2 == 1) for i, c in enumerate(CASES)])
def test_decode_attention_from_qkv(poisoned, block_size, heads, head_dim, dtype, norm):
    """The decode kernel with rope_and_cache folded in, against rope_and_cache_ref
    then paged_attention_ref: the output of every request's token, the k and v
    written at the tokens' slots (which hold NaN before, so a read of a slot
    not yet written shows), and every other slot left as it was. The last
    token belongs to no request (padding, slot -1). With 1, 3 and 7 splits of at
    most 5 key tiles, the key is written by the only program, by a middle
    split's, and beside empty splits, with the requests taken in batch order or
    reversed; half the cases norm q and k (Qwen3)."""
    from headrace.executor.models.layers import rope_cos_sin
    from headrace.checkpoint.config import RopeConfig
    from headrace.kernels.qkv import decode_attention, decode_attention_ref

    num_heads, num_kv_heads = heads
    seed = block_size * 997 + num_heads * 5 + head_dim + int(norm)
    _, kv_cache, qsl, seq_lens, block_tables, _ = _batch(DECODE, block_size, num_heads, num_kv_heads, head_dim, dtype,
                                                         seed=seed)
    g = torch.Generator().manual_seed(seed)
    rows = [i for i in range(len(seq_lens)) if qsl[i + 1] > qsl[i]]
    positions = torch.tensor([seq_lens[i] - 1 for i in rows] + [0])
    slots = torch.tensor([int(block_tables[i, (seq_lens[i] - 1) // block_size]) * block_size
                          + (seq_lens[i] - 1) % block_size for i in rows] + [-1])
    tokens = len(positions)
    qkv = (torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g) * 2).to(dtype)
    weights = [(torch.rand(head_dim, generator=g) + 0.5).to(dtype) for _ in range(2)] if norm else [None, None]
    cos_sin = rope_cos_sin(RopeConfig(theta=10_000.0), head_dim, 512)
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    flat[:, slots[:-1]] = float("nan")
    scale = head_dim**-0.5
    want_cache = kv_cache.clone()
    want = decode_attention_ref(qkv, positions, cos_sin, *weights, 1e-6, want_cache, slots, num_heads, qsl,
                                seq_lens, block_tables, scale)[: qsl[-1]]
    written = torch.zeros(flat.shape[1], dtype=torch.bool)
    written[slots[:-1]] = True

    def dev(x):
        return torch.tensor(x, dtype=torch.int32, device=DEVICE)

    reversed_rows = dev(list(range(len(seq_lens)))[::-1])  # programs in another order than the batch's
    for num_splits, ahead, order in [(1, False, reversed_rows), (3, True, None), (7, False, reversed_rows),
                                     (1, True, None)]:  # block ids read each way; rows in batch and reversed order
        got_cache = kv_cache.to(DEVICE)
        out = decode_attention(qkv.to(DEVICE), positions.to(DEVICE), cos_sin.to(DEVICE),
                               *[None if w is None else w.to(DEVICE) for w in weights], 1e-6, got_cache,
                               slots.to(DEVICE), num_heads, dev(qsl), dev(seq_lens), block_tables.to(DEVICE), scale,
                               max(seq_lens), num_splits, ahead, order)
        assert out.shape == (tokens, num_heads, head_dim) and out.dtype == dtype
        msg = lambda m: f"num_splits={num_splits}, ids_ahead={ahead}, order={order}: {m}"  # noqa: E731
        torch.testing.assert_close(out[: qsl[-1]].cpu().float(), want.float(), **_tol(dtype), msg=msg)
        got_flat = got_cache.cpu().view(2, -1, num_kv_heads, head_dim)
        torch.testing.assert_close(got_flat[:, written].float(), want_cache.view(2, -1, num_kv_heads, head_dim)[
            :, written].float(), **_tol(dtype), msg=msg)
        assert torch.equal(got_flat[:, ~written], flat[:, ~written]), f"{num_splits}, {ahead}: other slots changed"
