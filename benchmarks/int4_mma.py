"""kernels/int4_mma.py (4-bit projections on mma.sync) against what runs without it, on Qwen3-8B's projections.

    python3 benchmarks/int4_mma.py [--rows 1,2,4,8] [--configs 1:8,2:8,1:4,1:12]

For (N, K) in 6144x4096 (q|k|v), 4096x4096 (o), 24576x4096 (gate|up with SiLU-and-mul) and 4096x12288 (down),
group 128, bf16 rows: microseconds per call as int4_kernel.py times them (CUDA-graph replays cycling weight
copies past L2), against the floor (packed weights, scales, zeros, x and y at the measured copy rate). The peer
is what int4_linear runs with HEADRACE_INT4_MMA=0: the one-row kernel (kernels/int4_gemv.py, gated in its
epilogue) at one row, the tl.dot kernel (then SiLU-and-mul, gated) above. err: the largest difference from the
float32 product of the dequantized weights (gated: SiLU-and-mul of it in bf16), relative to its largest
value. Each config (R, programs an SM; kernels/int4_mma.CONFIGS) runs twice to check that the bits repeat.
"""
from __future__ import annotations

import argparse
import os

import torch
from benchmarks_common import graph_call_us, measure_ceilings
from int4_kernel import L2_BYTES, int4_layers

from headrace.kernels.activation import silu_and_mul, silu_and_mul_ref
from headrace.kernels.int4 import dequantize_int4, int4_linear
from headrace.kernels.int4_gemv import int4_gemv
from headrace.kernels.int4_mma import int4_mma

SHAPES = [(6144, 4096, False), (4096, 4096, False), (24576, 4096, True), (4096, 12288, False)]  # (N, K, gated)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--configs", default="1:8,2:8,1:4,1:12", help="R:programs an SM,...")
    args = parser.parse_args()
    configs = [tuple(map(int, c.split(":"))) for c in args.configs.split(",")]
    os.environ["HEADRACE_INT4_MMA"] = "0"  # the peer: int4_linear without this kernel
    bw, _ = measure_ceilings("cuda")
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s", flush=True)
    gen = torch.Generator().manual_seed(0)
    g = 128
    for n, k, gated in SHAPES:
        w_bytes = k * n // 2 + 2 * (k // g) * n * 2
        layers = int4_layers(n, k, g, max(2, -(-4 * L2_BYTES // w_bytes)), gen)
        qw, s, z, cnt = layers[0]
        w32 = dequantize_int4(qw, s, z, g, torch.float32)  # [N, K]
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).cuda()
            ref = x.float() @ w32.t()
            if gated:
                ref = silu_and_mul_ref(ref.to(torch.bfloat16)).float()
            top = ref.abs().max().item()
            floor = (w_bytes + 2 * rows * (k + n)) / bw * 1e6
            if rows == 1:
                name, peer = "int4_gemv", lambda lay: int4_gemv(x, *lay[:3], g, None, lay[3], gated=gated)
            elif gated:
                name, peer = "tl.dot + SiLU", lambda lay: silu_and_mul(int4_linear(x, *lay[:3], g, None, lay[3]))
            else:
                name, peer = "tl.dot", lambda lay: int4_linear(x, *lay[:3], g, None, lay[3])
            err = ((peer(layers[0]).float() - ref).abs().max() / top).item()
            t = graph_call_us([lambda lay=lay: peer(lay) for lay in layers])
            line = f"{n}x{k}{' gated' if gated else ''} rows {rows}: floor {floor:.1f} us; {name} {t:.1f} " \
                   f"({t / floor:.2f}x, err {err:.1e})"
            for cfg in configs:
                a = int4_mma(x, qw, s, z, g, None, cnt, gated=gated, config=cfg)
                same = torch.equal(a, int4_mma(x, qw, s, z, g, None, cnt, gated=gated, config=cfg))
                err = ((a.float() - ref).abs().max() / top).item()
                t = graph_call_us([lambda lay=lay: int4_mma(x, *lay[:3], g, None, lay[3], gated=gated, config=cfg)
                                   for lay in layers])
                line += f"; {cfg} {t:.1f} ({t / floor:.2f}x, err {err:.1e}{'' if same else ', bits differ'})"
            print(line, flush=True)


if __name__ == "__main__":
    main()
