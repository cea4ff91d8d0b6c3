"""The decode attention kernel (kernels/attention.py) by K split count, against the bytes it reads.

    python3 benchmarks/decode_attention.py [--batches 1,4,16,64] [--contexts 256,1024,4096] [--splits 1,2,...]
        [--ids-ahead auto|on|off] [--lengths uniform|mixed] [--heads 32,8] [--configs W,S,N;...]
        [--layout nhd|hnd]

Qwen3-8B's attention shape by default (32 query heads, 8 KV heads; --heads 16,8 is
Qwen3-0.6B's), head_dim 128, bf16 cache, 16-token blocks. With --lengths uniform each request has `context` tokens in
the cache; with mixed, a random count from 64 to 2 * context - 64 (mean
`context`) in a shuffled order, as a serving batch holds. The kernel is given
max_seq_len = the longest + 128 (a CUDA graph is captured with a bound above
the live contexts). Microseconds per call, timed as CUDA-graph replays cycling
through enough caches that none stays in L2; the floor is the K and V bytes at
the copy bandwidth measured in the same run. "auto" is the split count
paged_attention picks by itself, in batch order; "longest" is the same with the
requests taken longest first (the order the engine passes). --ids-ahead forces
one way of reading block ids (kernels/attention.py's _attend_keys); auto leaves
the choice to the kernel. --configs adds columns: the kernel at the split count it
picks, requests longest first, under those (warps, stages, BLOCK_N) launches
rather than attention.decode_config's. --layout hnd holds each block's KV heads one
after another (a head's 16 keys in 4 KiB together) rather than the engine's
tokens one after another (a key's 8 heads together), and hands the kernels the
same [2, blocks, block, KV heads, head_dim] view of it, with other strides.
"""
from __future__ import annotations

import argparse

import torch
from benchmarks_common import graph_call_us, heads_and_configs, measure_ceilings

from headrace.kernels.attention import _decode_num_splits, paged_attention

HEAD_DIM, BLOCK = 128, 16
L2_BYTES = 50 * 2**20


def lengths(batch: int, context: int, mixed: bool, gen: torch.Generator) -> torch.Tensor:  # [batch] int32
    if mixed:
        return torch.randint(64, max(65, 2 * context - 63), (batch,), generator=gen, dtype=torch.int32)
    return torch.full((batch,), context, dtype=torch.int32)


def caches(lens: torch.Tensor, count: int, gen: torch.Generator, heads: int, kv_heads: int, hnd: bool = False):
    """count (q, kv_cache, query_start_loc, seq_lens, block_tables) for requests of these lengths, blocks in a
    shuffled order; with hnd the cache's memory holds a block's heads one after another."""
    batch, blocks_per_req = len(lens), -(-int(lens.max()) // BLOCK)
    out = []
    for _ in range(count):
        kv = torch.randn(2, batch * blocks_per_req, BLOCK, kv_heads, HEAD_DIM, generator=gen).bfloat16().cuda()
        if hnd:
            kv = kv.transpose(2, 3).contiguous().transpose(2, 3)  # the same values, heads outermost in a block
        tables = torch.randperm(batch * blocks_per_req, generator=gen).reshape(batch, blocks_per_req)
        q = torch.randn(batch, heads, HEAD_DIM, generator=gen).bfloat16().cuda()
        qsl = torch.arange(batch + 1, dtype=torch.int32).cuda()
        out.append((q, kv, qsl, lens.cuda(), tables.to(torch.int32).cuda()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--contexts", default="256,1024,4096")
    parser.add_argument("--splits", default="1,2,4,8,16,24,32")
    parser.add_argument("--ids-ahead", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--lengths", choices=("uniform", "mixed"), default="uniform")
    parser.add_argument("--heads", default="32,8", help="query heads,KV heads")
    parser.add_argument("--configs", default="", help="WARPS,STAGES,BLOCK_N[;...]: decode launches to add")
    parser.add_argument("--layout", choices=("nhd", "hnd"), default="nhd",
                        help="the cache's memory order within a block: tokens outermost (the engine's) or heads")
    args = parser.parse_args()
    heads, kv_heads, configs = heads_and_configs(parser, args.heads, args.configs, "WARPS,STAGES,BLOCK_N")
    ahead = {"auto": None, "on": True, "off": False}[args.ids_ahead]
    bw, _ = measure_ceilings(torch.device("cuda"))
    gen = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, block ids ahead: {args.ids_ahead}, "
          f"lengths: {args.lengths}, layout: {args.layout}")
    splits = list(map(int, args.splits.split(",")))
    print(f"{'batch':>5} {'context':>7} {'floor us':>8} {'auto':>9} {'longest':>7} "
          + " ".join(f"{s:>7}" for s in splits) + "".join(f" {'/'.join(map(str, c)):>9}" for c in configs))
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            lens = lengths(batch, context, args.lengths == "mixed", gen)
            kv_bytes = 2 * int(lens.sum()) * kv_heads * HEAD_DIM * 2
            sets = caches(lens, max(2, -(-4 * L2_BYTES // kv_bytes)), gen, heads, kv_heads, args.layout == "hnd")
            bound = int(lens.max()) + 128
            longest = torch.argsort(lens, descending=True, stable=True).to(torch.int32).cuda()

            def us(n, **kw):
                return graph_call_us([lambda s=s: paged_attention(*s, 0.088, 1, bound, num_splits=n, ids_ahead=ahead,
                                                                  **kw) for s in sets])

            auto = _decode_num_splits(torch.device("cuda"), batch, kv_heads, bound)
            floor = kv_bytes / bw * 1e6
            cells = " ".join(f"{us(s):7.1f}" for s in splits)
            cells += "".join(f" {us(None, order=longest, decode_launch=c):9.1f}" for c in configs)
            print(f"{batch:>5} {context:>7} {floor:8.1f} {us(None):5.1f}/{auto:<3} {us(None, order=longest):7.1f} "
                  f"{cells}", flush=True)


if __name__ == "__main__":
    main()
