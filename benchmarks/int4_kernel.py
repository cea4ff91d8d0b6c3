"""int4_linear (kernels/int4.py) on Qwen3-8B's projection shapes, against its floor and bf16 F.linear.

    python3 benchmarks/int4_kernel.py [--ms 1,16,64,256,2048] [--shapes 4096x4096] [--group 128] [--sweep]
                                      [--stages 4,6,8]

For (N, K) in 6144x4096 (q|k|v), 4096x4096 (o_proj), 24576x4096 (gate|up) and
4096x12288 (down), as the model runs them, group size 128, bf16 activations,
and M tokens: microseconds per call, timed as CUDA-graph replays of calls that
cycle through enough copies of the weights that none is still in L2 (as in a
model, where each layer's weights are read once per step), each copy with its
own split-K counters as Int4Linear holds them. The floor is the packed weight,
scales, zeros, x and y bytes at the copy bandwidth, or 2 M N K FLOPs at the
bf16 matmul rate, whichever is longer, both measured in the same run; the peer
is F.linear with bf16 weights, timed the same way. err is int4_linear's
largest difference from int4_linear_ref relative to the largest output. The
table's config is timed at every M; at one row and from DEQUANTIZE_ROWS rows
int4_linear runs another path, timed on a line of its own. --sweep also times
the candidate configs of each M bucket, and at one row GEMV_SWEEP's configs of
the one-row kernel. --stages times the one-row kernel (table config) with its K
loop pipelined that many stages (by default 4 where K is whole, 1 where it is
split), and gate|up also gated (SiLU-and-mul in its epilogue, as the model runs
it); each line says whether its bits equal the default's.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from benchmarks_common import graph_call_us as per_call_us, measure_ceilings

from headrace.kernels.int4 import (
    DEQUANTIZE_ROWS, _Config, _launch, _pick_config, int4_linear, int4_linear_ref, split_k_tiles,
)
from headrace.kernels.int4_gemv import CONFIG as GEMV_CONFIG, int4_gemv
from headrace.kernels.splitk import counters

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # (N, K); Qwen3-8B's LM head is 151936x4096
L2_BYTES = 50 * 2**20
C = _Config
# Candidates per M bucket for --sweep: (block_m, block_n, block_k, num_warps, num_stages, scale_acc, split_k, regs).
SWEEP = {
    16: [C(16, 64, 128, 4, 3, True), C(16, 32, 128, 2, 3, True), C(16, 64, 128, 4, 3, False), C(16, 64, 128, 4, 2, True),
         C(16, 64, 128, 4, 3, True, 4), C(16, 64, 128, 4, 3, True, 8), C(16, 64, 128, 4, 3, True, 16),
         C(16, 128, 128, 8, 3, True), C(16, 64, 128, 4, 4, True), C(16, 64, 128, 4, 5, True),
         C(16, 64, 64, 4, 5, True), C(16, 64, 128, 4, 4, True, 1)],
    32: [C(32, 64, 64, 4, 3, False), C(32, 64, 128, 4, 3, True), C(32, 64, 128, 4, 3, False), C(16, 64, 128, 4, 3, True),
         C(32, 64, 64, 4, 4, False)],
    64: [C(64, 64, 64, 4, 4, False), C(64, 64, 64, 4, 3, False), C(64, 128, 64, 8, 3, False), C(64, 64, 128, 4, 3, False),
         C(32, 64, 64, 4, 3, False)],
    128: [C(128, 64, 64, 4, 3, False), C(64, 64, 64, 4, 4, False), C(64, 128, 64, 8, 3, False),
          C(128, 128, 64, 8, 3, False, 0, 128)],
    256: [C(128, 64, 64, 4, 3, False), C(128, 64, 64, 4, 3, False, 1), C(128, 128, 64, 8, 3, False, 0, 128),
          C(128, 64, 64, 4, 4, False), C(64, 64, 64, 4, 4, False)],
    None: [C(128, 128, 64, 8, 3, False, 1, 128), C(128, 256, 64, 16, 3, False, 1), C(256, 128, 64, 16, 3, False, 1),
           C(128, 256, 64, 16, 4, False, 1), C(256, 128, 64, 16, 4, False, 1), C(128, 64, 64, 4, 3, False, 1),
           C(256, 128, 64, 8, 3, False, 1)],
}

# One-row kernel (kernels/int4_gemv.py) candidates for --sweep: (block_n, block_k, num_warps, programs an SM).
# (slices of 256 and 512 span groups of 128: each int32 row then loads its own group's scale and zero)
GEMV_SWEEP = [(64, 128, 4, 4), (64, 128, 4, 12), (64, 128, 4, 16), (64, 64, 4, 8), (128, 128, 4, 8), (32, 128, 2, 8),
              (64, 128, 2, 8), (128, 64, 4, 8), (64, 256, 4, 8), (64, 256, 4, 4), (64, 512, 4, 8), (32, 256, 4, 8),
              (32, 512, 4, 8), (128, 256, 4, 8), (64, 256, 8, 8), (64, 32, 4, 8)]

def int4_layers(n: int, k: int, group: int, count: int, gen: torch.Generator):
    """count independent (qweight, scales, zeros, counts) on the GPU, random over the whole 4-bit range;
    counts: the layer's split-K counters, as Int4Linear holds them (without, each call would zero its own)."""
    out = []
    for _ in range(count):
        qweight = torch.randint(-2**31, 2**31 - 1, (k // 8, n), generator=gen, dtype=torch.int32)
        scales = torch.rand(k // group, n, generator=gen) * 0.002 + 0.0005
        zeros = torch.randint(0, 16, (k // group, n), generator=gen)
        out.append((qweight.cuda(), scales.to(torch.bfloat16).cuda(), zeros.to(torch.bfloat16).cuda(),
                    counters(split_k_tiles(n), "cuda")))
    return out


def bucket(m: int):
    return next(limit for limit in SWEEP if limit is None or m <= limit)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default="1,16,64,256,2048")
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="NxK,...")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--stages", default="", help="S,...: the one-row kernel's K loop at these stage counts")
    args = parser.parse_args()
    stages = [int(v) for v in args.stages.split(",") if v]
    if any(v < 1 for v in stages):
        parser.error(f"--stages takes counts >= 1, got {args.stages}")
    bw, rate = measure_ceilings("cuda")
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    print(f"{'N x K':>12} {'M':>5} {'int4 us':>8} {'floor us':>8} {'x floor':>7} {'bf16 us':>8} {'int4/bf16':>9}"
          f" {'err':>8}  config")
    gen = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        g = args.group
        w_bytes = k * n // 2 + 2 * (k // g) * n * 2
        layers = int4_layers(n, k, g, max(2, -(-4 * L2_BYTES // w_bytes)), gen)
        dense = [torch.randn(n, k, generator=gen).to(torch.bfloat16).cuda() * 0.02
                 for _ in range(max(2, -(-4 * L2_BYTES // (2 * n * k))))]
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
            got = int4_linear(x, *layers[0][:3], g, None, layers[0][3])
            want = int4_linear_ref(x, *layers[0][:3], g, None)
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            floor = max((w_bytes + 2 * m * (k + n)) / bw, 2 * m * n * k / rate) * 1e6
            peer = per_call_us([lambda w=w: F.linear(x, w) for w in dense])
            picked = _pick_config(m)
            configs = [picked] + [c for c in SWEEP[bucket(m)] if c != picked] if args.sweep else [picked]
            for cfg in configs:
                t = per_call_us([lambda lay=lay: _launch(x, *lay[:3], g, None, cfg, lay[3]) for lay in layers])
                mark = "table" if cfg == picked else ""
                print(f"{n:>6}x{k:<5} {m:>5} {t:8.1f} {floor:8.1f} {t / floor:7.2f} {peer:8.1f} {t / peer:9.2f}"
                      f" {err:8.1e}  {tuple(cfg)} {mark}", flush=True)
            if m >= DEQUANTIZE_ROWS or m == 1:  # what int4_linear runs there instead of the table's config
                t = per_call_us([lambda lay=lay: int4_linear(x, *lay[:3], g, None, lay[3]) for lay in layers])
                label = "one-row kernel, kernels/int4_gemv.py" if m == 1 else "dequantize + cuBLAS"
                print(f"{n:>6}x{k:<5} {m:>5} {t:8.1f} {floor:8.1f} {t / floor:7.2f} {peer:8.1f} {t / peer:9.2f}"
                      f" {err:8.1e}  {label} (int4_linear)", flush=True)
            if m == 1 and args.sweep:  # the one-row kernel's candidates
                for cfg in GEMV_SWEEP:
                    got = int4_gemv(x, *layers[0][:3], g, None, layers[0][3], config=cfg)
                    e = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                    t = per_call_us([lambda lay=lay: int4_gemv(x, *lay[:3], g, None, lay[3], config=cfg)
                                     for lay in layers])
                    print(f"{n:>6}x{k:<5} {m:>5} {t:8.1f} {floor:8.1f} {t / floor:7.2f} {peer:8.1f} {t / peer:9.2f}"
                          f" {e:8.1e}  one-row kernel {cfg} (table: {GEMV_CONFIG})", flush=True)
            if m == 1 and stages:  # the one-row kernel's K loop at other stage counts; gate|up also gated
                first = layers[0]
                for gated in (False, True) if (n, k) == SHAPES[2] else (False,):
                    base = int4_gemv(x, *first[:3], g, None, first[3], gated=gated)
                    for st in stages:
                        same = torch.equal(base, int4_gemv(x, *first[:3], g, None, first[3], gated=gated, stages=st))
                        t = per_call_us([lambda lay=lay: int4_gemv(x, *lay[:3], g, None, lay[3], gated=gated,
                                                                   stages=st) for lay in layers])
                        print(f"{n:>6}x{k:<5} {m:>5} {t:8.1f} {floor:8.1f} {t / floor:7.2f} {peer:8.1f}"
                              f" {t / peer:9.2f} {'':>8}  one-row kernel, {st} stages{', gated' if gated else ''}"
                              f" (bits as the default's: {same})", flush=True)


if __name__ == "__main__":
    main()
