"""dense_linear (kernels/dense.py) on decoder projection shapes, against its floor and cuBLAS.

    python3 benchmarks/dense_kernel.py [--ms 1,2,4,8,16,32] [--model 0.6b|8b|both] [--sweep]

For each projection of the Qwen3-0.6B (and Qwen3-8B) shape, bf16, M rows:
microseconds per call, timed as CUDA-graph replays cycling through enough weight
copies that none stays in L2, of
- the kernel with what the decoder folds into that projection: q|k|v and gate|up
  with the RMSNorm and residual add before (gate|up also with SiLU-and-multiply
  after), o and down alone;
- the same steps as separate kernels: the Triton RMSNorm, cuBLAS (F.linear), the
  Triton SiLU-and-multiply;
- cuBLAS alone.
The floor is the weight bytes at the copy bandwidth measured in this run.
--sweep times the kernel's candidate configs at 1 and 8 rows, each on the path
(FMAs or tl.dot) that dense_linear takes there, and at the end lists each model's
and row count's configs with their time on every shape, fastest summed first.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
from benchmarks_common import graph_call_us, measure_ceilings

from headrace.kernels.activation import silu_and_mul
from headrace.kernels.dense import (DOT_CONFIG, FEW_ROWS, FMA_ELEMENTS, dense_linear, fma_path, row_config,
                                    split_k_tiles)
from headrace.kernels.norm import rms_norm

L2_BYTES = 50 * 2**20
# (name, N, K, fused norm, gated): N counts the weight's rows
SHAPES = {
    "0.6b": [("qkv", 4096, 1024, True, False), ("o", 1024, 2048, False, False),
             ("gate_up", 6144, 1024, True, True), ("down", 1024, 3072, False, False)],
    "8b": [("qkv", 6144, 4096, True, False), ("o", 4096, 4096, False, False),
           ("gate_up", 24576, 4096, True, True), ("down", 4096, 12288, False, False)],
}


def sweep_configs(m: int, n: int, k: int, gated: bool) -> list[tuple[int, int, int, int]]:
    """--sweep's (ROWS, BLOCK_K, warps, stages) candidates at m rows on an n x k weight, for the path dense_linear
    takes there: without tl.dot (one row, or a few on a narrow weight: fma_path) weight rows a program (an even
    count gated: gate and up rows in pairs) and slices up to the whole K, keeping a few rows' per-lane sums
    within FMA_ELEMENTS; with tl.dot, its tiles."""
    if not fma_path(m, n, k):
        return list(itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (1, 3)))
    widths = [w for w in (512, 1024, 2048, 4096) if m == 1 or triton.next_power_of_2(m) * w <= FMA_ELEMENTS]
    rows = [r for r in ((1, 2, 4, 8, 16) if m == 1 else (1, 2, 4)) if not (gated and r == 1)]
    return list(itertools.product(rows, widths, (4, 8), (1, 3)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default="1,2,4,8,16,32")
    parser.add_argument("--model", default="both", choices=["0.6b", "8b", "both"])
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    bw, _ = measure_ceilings(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s; kernel up to {FEW_ROWS} rows in the model, "
          f"configs by shape (one row: dense.row_config), {DOT_CONFIG}")
    print(f"{'shape':>16} {'M':>3} {'fused us':>9} {'floor us':>9} {'x floor':>8} {'unfused us':>11} "
          f"{'cuBLAS us':>10}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    models = ["0.6b", "8b"] if args.model == "both" else [args.model]
    swept: dict[tuple, dict[tuple, dict[str, float]]] = {}  # (model, rows) -> config -> shape -> us
    for model, name, n, k, norm, gated in ((m, *s) for m in models for s in SHAPES[m]):
        count = max(2, -(-2 * L2_BYTES // (2 * n * k)))
        weights = [((torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16(),
                    torch.zeros(split_k_tiles(n), dtype=torch.int32, device="cuda")) for _ in range(count)]
        nw = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        floor = 2 * n * k / bw * 1e6
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            res = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            normed = (nw, 1e-6) if norm else None
            resid = res if norm else None

            def fused(w, c, cfg=None):
                return lambda: dense_linear(x, w, None, normed, resid, gated, c, cfg)

            def unfused(w, c):
                def call():
                    h = rms_norm(x, nw, 1e-6, res)[0] if norm else x
                    y = F.linear(h, w)
                    return silu_and_mul(y) if gated else y
                return call

            ours = graph_call_us([fused(*w) for w in weights])
            steps = graph_call_us([unfused(*w) for w in weights])
            cublas = graph_call_us([(lambda w=w: F.linear(x, w)) for w, _ in weights])
            print(f"{name + ' ' + str(n) + 'x' + str(k):>16} {m:>3} {ours:9.1f} {floor:9.1f} {ours / floor:8.2f} "
                  f"{steps:11.1f} {cublas:10.1f}" + (f"  {row_config(n, k, gated, normed=norm)}" if m == 1 else ""))
            if args.sweep and m in (1, 8):
                results = []
                for cfg in sweep_configs(m, n, k, gated):
                    try:
                        us = graph_call_us([fused(*w, cfg) for w in weights])
                    except Exception as e:  # a config that does not compile or fit
                        print(f"    {cfg}: {type(e).__name__}")
                        continue
                    results.append((us, cfg))
                    swept.setdefault((model, m), {}).setdefault(cfg, {})[name] = us
                print("    best configs: " + ", ".join(f"{cfg} {us:.1f}" for us, cfg in sorted(results)[:4]))
        del weights
        torch.cuda.empty_cache()
    for (model, m), by_config in swept.items():  # every config that ran on each shape, fastest summed first
        names = [s[0] for s in SHAPES[model]]
        print(f"\n{model}, M={m}, us by shape ({', '.join(names)}) and summed:")
        for cfg, times in sorted(by_config.items(), key=lambda c: sum(c[1].values())):
            if len(times) == len(names):
                print(f"    {cfg}: " + " ".join(f"{times[s]:6.1f}" for s in names) + f"  {sum(times.values()):7.1f}")


if __name__ == "__main__":
    main()
