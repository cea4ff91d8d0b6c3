"""Torch references in kernels/ against plain dense computations."""
from __future__ import annotations

import math

import pytest
import torch

from headrace.kernels.attention import paged_attention_ref, write_kv_ref
from headrace.kernels.sampling import gumbel_from_bits_ref, gumbel_sample_ref, uniform_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the logit-bias kernel: on a GPU, or the interpreter


def dense_causal_attention(q, k, v, scale):
    """q: [q_len, H, D] for the last q_len of k/v's [L, Hkv, D]; float64 reference."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    L, n = k.shape[0], q.shape[0]
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    mask = torch.arange(L)[None, :] > torch.arange(L - n, L)[:, None]
    return torch.einsum("hqk,khd->qhd", s.masked_fill(mask, -math.inf).softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 1)])
def test_paged_attention_matches_dense(block_size, heads):
    g = torch.Generator().manual_seed(block_size * 100 + heads[0] * 10 + heads[1])
    num_heads, num_kv_heads = heads
    head_dim = 16
    # (cached tokens, new query tokens) per request: decode rows, a fresh prefill, a chunk over a prefix
    reqs = [(0, 5), (9, 1), (30, 7), (0, 1), (47, 1), (16, 16)]
    max_blocks = max(-(-(c + n) // block_size) for c, n in reqs)
    num_blocks = len(reqs) * max_blocks + 3
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g)  # blocks scattered through the pool
    block_tables = torch.zeros(len(reqs), max_blocks, dtype=torch.int32)
    qs, ks, vs, slots, qsl, seq_lens, full = [], [], [], [], [0], [], []
    for i, (cached, n) in enumerate(reqs):
        L = cached + n
        blocks = perm[i * max_blocks : (i + 1) * max_blocks]
        block_tables[i] = blocks.int()
        k_all = torch.randn(L, num_kv_heads, head_dim, generator=g)
        v_all = torch.randn(L, num_kv_heads, head_dim, generator=g)
        pos = torch.arange(L)
        flat = blocks[pos // block_size] * block_size + pos % block_size
        kv_cache.view(2, -1, num_kv_heads, head_dim)[0, flat[:cached]] = k_all[:cached]
        kv_cache.view(2, -1, num_kv_heads, head_dim)[1, flat[:cached]] = v_all[:cached]
        qs.append(torch.randn(n, num_heads, head_dim, generator=g))
        ks.append(k_all[cached:])
        vs.append(v_all[cached:])
        slots.append(flat[cached:])
        qsl.append(qsl[-1] + n)
        seq_lens.append(L)
        full.append((k_all, v_all))
    q = torch.cat(qs)
    slot_mapping = torch.cat(slots)
    slot_mapping = torch.cat([slot_mapping, torch.tensor([-1])])  # a padding token is skipped
    write_kv_ref(torch.cat(ks + [torch.randn(1, num_kv_heads, head_dim)]),
                 torch.cat(vs + [torch.randn(1, num_kv_heads, head_dim)]), kv_cache, slot_mapping)
    out = paged_attention_ref(q, kv_cache, qsl, seq_lens, block_tables, head_dim**-0.5)
    for i, (k_all, v_all) in enumerate(full):
        ref = dense_causal_attention(qs[i], k_all, v_all, head_dim**-0.5)
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]].double(), ref, rtol=1e-5, atol=1e-5)


def test_uniform_is_a_function_of_seed_and_position():
    seeds = torch.tensor([0, 1, -5, 2**62, 0], dtype=torch.int64)
    pos = torch.tensor([0, 0, 3, 7, 1], dtype=torch.int64)
    u = uniform_ref(seeds, pos, 1000)
    assert ((u > 0) & (u < 1)).all()
    again = uniform_ref(seeds.flip(0), pos.flip(0), 1000).flip(0)  # order within the batch is irrelevant
    assert torch.equal(u, again)
    assert not torch.equal(u[0], u[4])  # same seed, other position
    assert not torch.equal(u[0], u[1])  # other seed


def test_uniform_statistics():
    u = uniform_ref(torch.arange(64, dtype=torch.int64) * 7919, torch.arange(64, dtype=torch.int64), 4096).flatten()
    hist = torch.histc(u.float(), bins=16, min=0, max=1)
    expected = u.numel() / 16
    chi2 = (((hist - expected) ** 2) / expected).sum().item()
    assert chi2 < 40  # 15 degrees of freedom: p < 0.001 would be about 37.7; a biased source lands far above
    assert abs(u.mean().item() - 0.5) < 0.005
    # neighbouring token ids are not correlated
    c = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()
    assert abs(c) < 0.01


def edge_bits() -> torch.Tensor:
    """Bits over the whole range, densest where the noise is hardest: both ends and the halves' seam."""
    g = torch.Generator().manual_seed(0)
    ends = torch.arange(4096, dtype=torch.int64)
    return torch.cat([ends, 2**31 - 2048 + ends, 2**32 - 4096 + ends, torch.randint(0, 2**32, (100_000,), generator=g)])


def test_gumbel_noise_float32_against_float64():
    """The float32 noise is -log(-log(u)) to a few float32 ulps everywhere, also where
    u itself would round to 1 in float32 (the top 2**7 bit patterns) and noise runs to 22.9."""
    bits = edge_bits()
    truth = -torch.log(-torch.log((bits.double() + 0.5) / 2.0**32))
    got = gumbel_from_bits_ref(bits)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    err = (got.double() - truth).abs()
    assert (err <= 4e-7 * truth.abs().clamp(min=1.0)).all(), err.max()
    assert got.max() > 22.8 and got.min() < -3.0  # the two ends are reached


@pytest.mark.parametrize("temperature", [None, 0.45, 1.7])
def test_gumbel_max_samples_softmax(temperature):
    """gumbel_sample_ref's draws, one per seed, follow softmax(logits / temperature)."""
    torch.manual_seed(0)
    logits = torch.randn(12) * 1.5
    n = 40000
    seeds, positions = torch.arange(n, dtype=torch.int64), torch.full((n,), 5, dtype=torch.int64)
    temps = None if temperature is None else torch.full((n,), temperature)
    samples = gumbel_sample_ref(logits.expand(n, 12), seeds, positions, temps)
    counts = torch.bincount(samples, minlength=12).double()
    expected = (logits / (temperature or 1.0)).softmax(-1).double() * n
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 35  # 11 degrees of freedom, p ~ 0.0003


@pytest.mark.parametrize("rows, slots, max_bias, vocab", [(1, 1, 4, 10), (5, 9, 128, 300), (17, 20, 300, 1000)])
def test_logit_bias_kernel_matches_reference(rows, slots, max_bias, vocab):
    from headrace.kernels.penalties import apply_logit_bias, apply_logit_bias_ref

    g = torch.Generator().manual_seed(rows)
    idx = torch.randperm(slots, generator=g)[:rows]
    num = torch.randint(0, max_bias + 1, (slots,), generator=g, dtype=torch.int32)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:max_bias] for _ in range(slots)])
    values = torch.randn(slots, max_bias, generator=g) * 10
    base = torch.randn(rows, vocab, generator=g)
    ref, logits = base.clone(), base.clone().to(DEVICE)
    apply_logit_bias_ref(ref, idx, ids, values, num)
    apply_logit_bias(logits, *(t.to(DEVICE) for t in (idx, ids, values, num)))
    torch.testing.assert_close(logits.cpu(), ref)
    plain = base.clone()  # the reference itself against a plain loop
    for r in range(rows):
        s = int(idx[r])
        for j in range(int(num[s])):
            plain[r, ids[s, j]] += values[s, j]
    torch.testing.assert_close(ref, plain)
