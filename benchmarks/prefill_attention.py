"""The general (prefill) attention kernel (kernels/attention.py) against its FLOP floor and torch's
flash attention, on the prompts of a mixed step.

    python3 benchmarks/prefill_attention.py [--cases 8x1024,32x256,2x4096,chunk,mixed] [--heads 16,8]
                                            [--configs BM,BN,W,S;...] [--sweep]

By default Qwen3-0.6B's attention shape (16 query heads, 8 KV heads; --heads 32,8 is Qwen3-8B's),
head_dim 128, bf16, 16-token blocks scattered through the pool. Cases: NxL is N fresh prompts of L
tokens; chunk is a 2048-token chunk over a 2048-token cached prefix; mixed is the community workload's
prompts (100 to 1024 tokens, seed 0) up to 8192 tokens, as one of its mixed steps holds. The floor is
the causal product's FLOPs (each query against the keys up to its own, two matmuls) at the bf16 matmul
rate measured in this run. The peer is torch's scaled_dot_product_attention on the flash backend over
contiguous per-request tensors (the KV heads repeated beforehand, outside the timing; one call per
distinct prompt length, the case's time their sum), where it applies: a chunk over a cached prefix is
not a square causal product. Microseconds per call, from CUDA-graph replays over enough copies of the
inputs that they do not stay in L2. --configs adds the kernel under those (BLOCK_M, BLOCK_N, warps,
stages), --sweep under each of a grid; the five fastest are printed.
"""
from __future__ import annotations

import argparse
import itertools
import random

import torch
from benchmarks_common import graph_call_us, heads_and_configs, measure_ceilings

from headrace.kernels.attention import paged_attention

HEAD_DIM, BLOCK = 128, 16
L2_BYTES = 50 * 2**20
SWEEP = [c for c in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
         if not (c[0] == 64 and c[2] == 8) and not (c[1] == 128 and c[3] == 4)]


def requests(case: str) -> list[tuple[int, int]]:
    """(cached tokens, new tokens) per request."""
    if case == "chunk":
        return [(2048, 2048)]
    if case == "mixed":
        rng, reqs = random.Random(0), []
        while True:
            n = rng.randint(100, 1024)
            if sum(r[1] for r in reqs) + n > 8192:
                return reqs
            reqs.append((0, n))
    n, length = map(int, case.split("x"))  # ValueError unless NxL
    if n < 1 or length < 2:
        raise ValueError(case)
    return [(0, length)] * n


def causal_flops(reqs, heads: int) -> int:
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in reqs)  # (query, visible key) pairs
    return 4 * HEAD_DIM * heads * pairs


def inputs(reqs, heads: int, kv_heads: int, gen: torch.Generator):
    """(q, kv_cache, query_start_loc, seq_lens, block_tables) on the GPU, blocks in a shuffled order."""
    blocks = [-(-(c + n) // BLOCK) for c, n in reqs]
    perm = torch.randperm(sum(blocks), generator=gen).int()
    width = max(blocks)
    table = torch.zeros(len(reqs), width, dtype=torch.int32)
    start = 0
    for i, b in enumerate(blocks):
        table[i, :b] = perm[start:start + b]
        start += b
    tokens = sum(n for _, n in reqs)
    q = torch.randn(tokens, heads, HEAD_DIM, generator=gen).to(torch.bfloat16)
    cache = torch.randn(2, sum(blocks), BLOCK, kv_heads, HEAD_DIM, generator=gen).to(torch.bfloat16)
    qsl = torch.tensor([0] + list(itertools.accumulate(n for _, n in reqs)), dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in reqs], dtype=torch.int32)
    return tuple(t.cuda() for t in (q, cache, qsl, seq_lens, table))


def flash_calls(reqs, heads: int, gen: torch.Generator) -> list | None:
    """The peer's calls for one copy of the case: one per distinct prompt length, or None."""
    if any(c for c, _ in reqs):
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    calls = []
    for length in sorted({n for _, n in reqs}):
        count = sum(1 for _, n in reqs if n == length)
        q, k, v = (torch.randn(count, heads, length, HEAD_DIM, generator=gen).to(torch.bfloat16).cuda()
                   for _ in range(3))

        def call(q=q, k=k, v=v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        calls.append(call)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="8x1024,32x256,2x4096,chunk,mixed")
    parser.add_argument("--heads", default="16,8", help="query heads, KV heads")
    parser.add_argument("--configs", default="", help="BLOCK_M,BLOCK_N,warps,stages;... to time the kernel under too")
    parser.add_argument("--sweep", action="store_true", help="the kernel under every config of a grid too")
    args = parser.parse_args()
    heads, kv_heads, configs = heads_and_configs(parser, args.heads, args.configs, "BLOCK_M,BLOCK_N,WARPS,STAGES")
    try:
        cases = {case: requests(case) for case in args.cases.split(",")}
    except ValueError:
        parser.error(f"--cases takes NxL, chunk or mixed, comma-separated, got {args.cases!r}")
    configs += SWEEP if args.sweep else []
    _, rate = measure_ceilings(torch.device("cuda"))
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    print(f"{torch.cuda.get_device_name()}: bf16 matmul {rate / 1e12:.0f} TFLOP/s; us a call (x floor)")
    for case, reqs in cases.items():
        kv_bytes = 2 * sum(c + n for c, n in reqs) * kv_heads * HEAD_DIM * 2
        sets = [inputs(reqs, heads, kv_heads, gen) for _ in range(max(2, -(-2 * L2_BYTES // kv_bytes)))]
        max_q, max_seq = max(n for _, n in reqs), max(c + n for c, n in reqs)
        floor = causal_flops(reqs, heads) / rate * 1e6

        def cell(us: float) -> str:
            return f"{us:.1f} ({us / floor:.2f})"

        ours = graph_call_us([lambda s=s: paged_attention(*s, scale, max_q, max_seq) for s in sets])
        peer = flash_calls(reqs, heads, gen)
        peer_us = "-" if peer is None else cell(graph_call_us(peer) * len(peer))  # us a call -> the case
        print(f"{case} ({len(reqs)} requests, {sum(n for _, n in reqs)} tokens): floor {floor:.1f} us; "
              f"kernel {cell(ours)}; torch flash {peer_us}", flush=True)
        if configs:
            from headrace.kernels.attention import launch_prefill

            timed = []
            for config in configs:
                def call(s, config=config):
                    out = torch.empty_like(s[0])
                    launch_prefill(s[0], out, *s[1:], scale, max_q, config=config)
                try:
                    timed.append((graph_call_us([lambda s=s: call(s) for s in sets]), config))
                except Exception as e:  # a config past the shared memory: reported, not timed
                    print(f"  {config}: {type(e).__name__}")
            timed.sort()
            print("  (BLOCK_M, BLOCK_N, warps, stages), fastest first: "
                  + ", ".join(f"{c} {cell(t)}" for t, c in timed[:5]), flush=True)


if __name__ == "__main__":
    main()
