"""The Gumbel sampling kernel (kernels/sampling.py) against the logits' bytes and torch's sampling.

    python3 benchmarks/sampling_kernel.py [--rows 1,8,64,128,192,256] [--vocab 151936] [--temperature 0.6]

Each call samples one token per row from bf16 logits [rows, vocab] (Qwen3's vocabulary by default) at
the given temperature, with per-row seeds: `gumbel_sample` on the rows' own seeds and temperatures, and
"by slot" as the sampler and the sampling graphs call it (seeds and temperatures read at each row's slot,
a kept counts buffer). The floor is the logits' bytes at the copy rate measured in the same run. The peer
is the usual torch sampler: softmax(logits / temperature) divided by exponential noise drawn in place,
argmax (no per-row seeds). Microseconds per call, from CUDA-graph replays over enough copies of the logits
that they do not stay in L2.
"""
from __future__ import annotations

import argparse

import torch
from benchmarks_common import graph_call_us, measure_ceilings

from headrace.kernels.sampling import gumbel_sample

L2_BYTES = 50 * 2**20


def torch_sample(logits: torch.Tensor, temperature: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    probs = (logits.float() / temperature[:, None]).softmax(dim=-1)
    return probs.div_(noise.exponential_()).argmax(dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,8,64,128,192,256")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--temperature", type=float, default=0.6)
    args = parser.parse_args()
    try:
        rows_list = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows takes comma-separated counts, got {args.rows!r}")
    if min(rows_list) < 1 or args.vocab < 1 or args.temperature <= 0:
        parser.error("--rows and --vocab must be positive, --temperature above 0")
    dev = torch.device("cuda")
    bw, _ = measure_ceilings(dev)
    print(f"copy {bw / 1e12:.2f} TB/s; vocab {args.vocab}, temperature {args.temperature}, bf16 logits")
    print(f"{'rows':>5} {'floor us':>9} {'gumbel_sample':>14} {'x floor':>8} {'by slot':>8} {'torch':>8}")
    for rows in rows_list:
        nbytes = rows * args.vocab * 2
        copies = max(2, min(16, -(-2 * L2_BYTES // nbytes)))
        logits = [torch.randn(rows, args.vocab, device=dev).bfloat16() * 3 for _ in range(copies)]
        seeds = torch.randint(0, 2**62, (rows,), device=dev)
        positions = torch.randint(0, 2**20, (rows,), device=dev)
        temps = torch.full((rows,), args.temperature, device=dev)
        noise = torch.empty(rows, args.vocab, device=dev)
        slots, counts = torch.arange(rows, device=dev), torch.zeros(rows, dtype=torch.int32, device=dev)
        ours = graph_call_us([lambda x=x: gumbel_sample(x, seeds, positions, temps) for x in logits])
        by_slot = graph_call_us([lambda x=x: gumbel_sample(x, seeds, positions, temps, rows=slots, counts=counts)
                                 for x in logits])
        peer = graph_call_us([lambda x=x: torch_sample(x, temps, noise) for x in logits])
        floor = nbytes / bw * 1e6
        print(f"{rows:5d} {floor:9.1f} {ours:14.1f} {ours / floor:8.2f} {by_slot:8.1f} {peer:8.1f}", flush=True)


if __name__ == "__main__":
    main()
