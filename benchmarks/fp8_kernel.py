"""fp8_linear (kernels/fp8.py) on Qwen3-8B's projection shapes, against its floor and bf16 F.linear.

    python3 benchmarks/fp8_kernel.py [--ms 1,4,16,32,64] [--sweep] [--best-out FILE]

For (N, K) in 4096x4096 (o_proj), 6144x4096 (q|k|v), 24576x4096 (gate|up) and
4096x12288 (down), bf16 activations and M tokens: microseconds per call of the
whole layer (the few-rows Triton kernel up to FEW_ROWS rows; per-token
activation quantization, then fp8_mm up to MM_ROWS and torch._scaled_mm
above), of the few-rows kernel
(up to 64 rows) and of quantization plus _scaled_mm, timed as CUDA-graph
replays cycling through enough weight copies that none stays in L2. The floor
is the E4M3 weight bytes at the copy bandwidth measured in this run; the peer
is F.linear on bf16 weights, timed the same way. --sweep times, at each of
--ms, the few-rows kernel's candidate configs up to FEW_ROWS rows and fp8_mm's
(on rows quantized beforehand) beyond, and at the end ranks each row count's
configs by their time summed over the shapes (a config that failed on a shape is
left out), with each shape's time and each shape's fastest; --best-out writes
those fastest as JSON ({rows: {"NxK": [config, us]}}).
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from benchmarks_common import graph_call_us, measure_ceilings

from headrace.kernels.fp8 import (DOT_CONFIG, DOT_WIDE_CONFIG, FEW_ROWS, MM_CONFIGS,
                                  PROGRAMS_PER_SM, ROW_CONFIG, few_rows_config, fp8_few_rows, fp8_linear, fp8_mm,
                                  mm_config, quantize_rows, quantize_rows_triton)
from headrace.kernels.splitk import counters

SHAPES = [(4096, 4096), (6144, 4096), (24576, 4096), (4096, 12288)]  # (N, K)
L2_BYTES = 50 * 2**20


def per_call_us(make_call, layers: list) -> float:
    """Median microseconds of one call, one call per layer's weights."""
    return graph_call_us([make_call(*layer) for layer in layers])


def scaled_mm(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Per-token quantization, then cuBLAS's FP8 GEMM."""
    x_q, x_s = quantize_rows_triton(x)
    return torch._scaled_mm(x_q, w.t(), scale_a=x_s, scale_b=s.t(), out_dtype=x.dtype)


def sweep_configs(m: int):
    """--sweep's candidates at m rows: fp8_few_rows' (BLOCK_N, BLOCK_K, warps, stages[, programs an SM]) up
    to FEW_ROWS rows, fp8_mm's (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, programs an SM) beyond."""
    if m == 1:
        return itertools.product((4, 8, 16, 32), (512, 1024, 2048), (4, 8), (1, 2, 3, 4))
    if m <= FEW_ROWS:
        return itertools.product((16, 32, 64), (128, 256, 512), (4,), (2, 3, 4), (1, 2, 3))
    block_m = (32, 64) if m <= 32 else (64,)
    return itertools.product(block_m, (32, 64, 128), (64, 128, 256), (4,), (2, 3, 4, 5), (1, 2))


def in_use_config(m: int, n: int) -> tuple:
    """The config the launcher picks at m rows for an N-feature weight, as the sweep names it."""
    cuda = torch.device("cuda")
    if m == 1:
        return ROW_CONFIG
    return (*few_rows_config(m, n, cuda), PROGRAMS_PER_SM) if m <= FEW_ROWS else mm_config(m, n, cuda)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default="1,4,16,32,64")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--best-out", default="", help="with --sweep: write each shape's fastest config here")
    args = parser.parse_args()
    if args.best_out and not args.sweep:
        parser.error("--best-out writes the sweep's fastest configs: it needs --sweep")
    bw, _ = measure_ceilings(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s; few-rows kernel up to {FEW_ROWS} rows, "
          f"configs {ROW_CONFIG} (one row), {DOT_CONFIG} ({DOT_WIDE_CONFIG} wide); fp8_mm (up to rows, narrow, wide) "
          f"{MM_CONFIGS}")
    print(f"{'N x K':>12} {'M':>4} {'layer us':>9} {'floor us':>9} {'x floor':>8} {'few-rows':>9} {'_scaled_mm':>10} "
          f"{'bf16 us':>8}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    swept: dict[int, dict[tuple, list[float]]] = {}  # rows -> config -> us on each shape it ran
    for n, k in SHAPES:
        count = max(2, -(-2 * L2_BYTES // (n * k)))
        weights = [quantize_rows(torch.randn(n, k, device="cuda", generator=gen) * 0.02) + (counters(n, "cuda"),)
                   for _ in range(count)]
        dense = [(torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16() for _ in range(count)]
        floor = n * k / bw * 1e6  # the E4M3 weights read once
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            layer = per_call_us(lambda w, s, c: lambda: fp8_linear(x, w, s, None, counts=c), weights)
            few = per_call_us(lambda w, s, c: lambda: fp8_few_rows(x, w, s, None, c), weights) if m <= 64 else 0
            cublas = per_call_us(lambda w, s, c: lambda: scaled_mm(x, w, s), weights)
            peer = per_call_us(lambda w: lambda: F.linear(x, w), [(w,) for w in dense])
            print(f"{n:>6}x{k:<5} {m:>4} {layer:9.1f} {floor:9.1f} {layer / floor:8.2f} {few:9.1f} {cublas:10.1f} "
                  f"{peer:8.1f}")
            if args.sweep:
                x_q, x_s = quantize_rows_triton(x)
                results = []
                for cfg in sweep_configs(m):
                    def call(w, s, c, cfg=cfg):
                        if m > FEW_ROWS:
                            return lambda: fp8_mm(x_q, x_s, w, s, None, x.dtype, c, cfg)
                        return lambda: fp8_few_rows(x, w, s, None, c, cfg)
                    try:
                        us = per_call_us(call, weights)
                    except Exception as e:  # a config that does not compile or fit
                        print(f"    {cfg}: {type(e).__name__}")
                        continue
                    results.append((us, cfg))
                    swept.setdefault(m, {}).setdefault(cfg, []).append(us)
                print("    best configs: " + ", ".join(f"{cfg} {us:.1f}" for us, cfg in sorted(results)[:4]))
        del weights, dense
        torch.cuda.empty_cache()
    names = [f"{n}x{k}" for n, k in SHAPES]
    best: dict[int, dict[str, tuple]] = {}
    for m, by_config in swept.items():
        ranked = sorted((sum(times), cfg) for cfg, times in by_config.items() if len(times) == len(SHAPES))
        in_use = [in_use_config(m, n) for n, _ in SHAPES]
        print(f"M={m}, us summed over the {len(SHAPES)} shapes, and each shape's: " + "  ".join(names))
        for i, (us, cfg) in enumerate(ranked):
            if i < 8 or cfg in in_use:
                print(f"    {str(cfg):<28} {us:7.1f}  " + "  ".join(f"{t:7.1f}" for t in by_config[cfg])
                      + ("  (in use)" if cfg in in_use else ""))
        if all(cfg in by_config and len(by_config[cfg]) == len(SHAPES) for cfg in in_use):
            print(f"    the configs in use, summed: {sum(by_config[c][j] for j, c in enumerate(in_use)):.1f}")
        best[m] = {}
        for j, name in enumerate(names):
            us, cfg = min((times[j], cfg) for cfg, times in by_config.items() if len(times) == len(SHAPES))
            best[m][name] = (cfg, us)
        print("    fastest on each shape: " + ", ".join(f"{name} {cfg} {us:.1f}" for name, (cfg, us) in best[m].items())
              + f"; summed {sum(us for _, us in best[m].values()):.1f}")
    if args.best_out:
        with open(args.best_out, "w") as f:
            json.dump(best, f)


if __name__ == "__main__":
    main()
