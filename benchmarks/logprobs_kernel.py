"""A step's logprobs (the sampled token and the top-N, packed for the wire) on
the GPU: kernels/logprobs.py's top_logprobs against the path it replaced.

    python3 benchmarks/logprobs_kernel.py [--rows 1,8,64,256] [--vocab 151936] [--n 5,20]

The peer is the replaced path: torch.topk for the top-N ids, then the
compute_scores and token_ranks kernels (each reads the logits again) and the
packing copies. Microseconds a call two ways: as CUDA-graph replays (GPU time
only), and eager with a synchronize after every 20 calls (what the engine's
sampler pays, launches included, since it runs outside the step's graph). The
floor is the float32 logits read once at the copy bandwidth. err: whether the
packed ids match and the largest score difference from the replaced path.
"""
from __future__ import annotations

import argparse
import time

import torch
from benchmarks_common import graph_call_us, measure_ceilings

from headrace.kernels.logprobs import compute_scores, token_ranks, top_logprobs


def replaced(logits, sampled, act, n):
    """pack_logprobs before top_logprobs, as it ran on a GPU."""
    ids = torch.full((logits.shape[0], n + 1), -1, dtype=torch.long, device=logits.device)
    ids[:, 0] = sampled
    if n:
        ids[:, 1:] = logits.topk(n, dim=-1).indices
    scores = compute_scores(logits, ids, act)
    ranks = token_ranks(logits, sampled)
    return torch.cat([ids, ranks[:, None]], dim=1).int(), torch.cat([scores, scores[:, :1]], dim=1)


def eager_us(fn, calls: int = 20, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,8,64,256")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--n", default="5,20")
    args = parser.parse_args()
    bw, _ = measure_ceilings("cuda")
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s; vocabulary {args.vocab}")
    print(f"{'rows':>5} {'n':>3} {'floor us':>8} {'new graph':>9} {'old graph':>9} {'new eager':>9} {'old eager':>9}"
          f" {'new x floor':>11}  err")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows in map(int, args.rows.split(",")):
        for n in map(int, args.n.split(",")):
            logits = torch.randn(rows, args.vocab, device="cuda", generator=gen) * 3
            sampled = torch.randint(0, args.vocab, (rows,), device="cuda", generator=gen)
            act = torch.zeros(rows, dtype=torch.int32, device="cuda")
            new_i, new_f = top_logprobs(logits, sampled, act, n)
            old_i, old_f = replaced(logits, sampled, act, n)
            err = f"ids {'equal' if torch.equal(new_i, old_i) else 'DIFFER'}, scores {(new_f - old_f).abs().max():.1e}"
            floor = rows * args.vocab * 4 / bw * 1e6
            new_g = graph_call_us([lambda: top_logprobs(logits, sampled, act, n)])
            old_g = graph_call_us([lambda: replaced(logits, sampled, act, n)])
            new_e = eager_us(lambda: top_logprobs(logits, sampled, act, n))
            old_e = eager_us(lambda: replaced(logits, sampled, act, n))
            print(f"{rows:>5} {n:>3} {floor:8.1f} {new_g:9.1f} {old_g:9.1f} {new_e:9.1f} {old_e:9.1f}"
                  f" {new_g / floor:11.2f}  {err}", flush=True)


if __name__ == "__main__":
    main()
