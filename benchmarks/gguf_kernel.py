"""gguf_linear (kernels/gguf.py) on Qwen3-8B's projection shapes, against its floor and bf16 F.linear.

    python3 benchmarks/gguf_kernel.py [--formats Q4_K,Q6_K] [--ms 1,16,256,512,2048] [--shapes 4096x4096]
                                      [--sweep] [--warm-only]

For each format, (N, K) in 4096x4096, 12288x4096 (gate/up) and 4096x12288
(down), and M tokens: microseconds per call, timed as CUDA-graph replays of
calls that cycle through enough copies of the weight that none is still in L2
(as in a model, where each layer's weights are read once per step). The floor
is the packed weight, x and y bytes at the copy bandwidth plus 2 M N K FLOPs at
the bf16 matmul rate, both measured in the same run; the peer is F.linear on
the same shape with bf16 weights, and a row "torch" times gguf_linear_ref
(dequantize_gguf to bf16, then F.linear). From 256 rows on, a row "dequantize
+ cuBLAS" times dequantize_gguf_triton then F.linear (the Triton dequantization
alone in its config column) next to the tl.dot kernel's row, so that
DEQUANTIZE_ROWS can be set from one run; "(gguf_linear)" marks the path
gguf_linear takes at that M. The error column is the largest
|y - y_ref| / (|x| |W|^T). --sweep times candidate configs of each M bucket
instead of the chosen one; --warm-only compiles (one process per format can
fill Triton's cache).
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from benchmarks_common import measure_ceilings

from headrace.kernels.gguf import (
    DEQUANTIZE_ROWS, FORMATS, _Config, _launch, _pick_config, dequantize_gguf, dequantize_gguf_triton,
    gguf_linear_ref, pack_gguf, packed_nbytes,
)

SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288)]
DEQUANTIZE_FROM = 256  # the least M with a "dequantize + cuBLAS" row
F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [208]}
# Candidates per M bucket for --sweep: (gemv, block_n, block_m, units, num_warps, num_stages, split_k, x_once).
SWEEP = {
    1: [_Config(True, 4, 1, 128, 4, 1), _Config(True, 4, 1, 64, 2, 1), _Config(True, 8, 1, 64, 2, 1),
        _Config(True, 2, 1, 64, 2, 1), _Config(True, 4, 1, 128, 2, 1), _Config(True, 2, 1, 128, 2, 1),
        _Config(True, 2, 1, 128, 2, 1, 0, False), _Config(True, 4, 1, 64, 4, 1, 0, False),
        _Config(True, 4, 1, 128, 4, 1, 0, False), _Config(True, 2, 1, 64, 2, 1, 0, False)],
    16: [_Config(False, 64, 16, 4, 4, 4), _Config(False, 128, 16, 4, 8, 3), _Config(False, 64, 16, 8, 4, 3),
         _Config(False, 32, 16, 8, 4, 3), _Config(False, 32, 16, 4, 4, 4)],
    256: [_Config(False, 64, 128, 4, 4, 3, 1), _Config(False, 64, 64, 4, 4, 4, 1), _Config(False, 128, 128, 4, 8, 3, 1),
          _Config(False, 128, 64, 4, 4, 3, 1)],
    2048: [_Config(False, 256, 128, 4, 8, 2, 1), _Config(False, 128, 256, 4, 8, 2, 1),
           _Config(False, 128, 128, 4, 8, 3, 1), _Config(False, 64, 128, 4, 4, 3, 1)],
}


def random_packed(name: str, n: int, k: int, copies: int) -> list:
    """`copies` PackedGGUF [n, k] of random blocks (float16 scales about 2^-7), each in its own memory."""
    fmt = FORMATS[name]
    raw = torch.randint(0, 256, (n * k // fmt.block, fmt.size), dtype=torch.uint8, device="cuda")
    for off in F16_FIELDS[name]:
        scale = torch.empty(raw.shape[0], device="cuda").uniform_(-2.0 ** -7, 2.0 ** -7).half()
        raw[:, off:off + 2] = scale.view(torch.uint8).reshape(-1, 2)
    raw = raw.reshape(n, -1)
    return [pack_gguf(name, raw, (n, k)) for _ in range(copies)]


def graph_us(calls: list, per_graph: int = 24) -> float:
    """Median microseconds per call of `calls` (cycled), replayed as one CUDA graph."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(per_graph):
            calls[i % len(calls)]()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per_graph)
    return statistics.median(times)


def copies_for(nbytes: int) -> int:
    """Enough copies that cycling through them reads from DRAM: together at least 4 L2s."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    return max(2, -(-4 * l2 // max(nbytes, 1)))


def max_rel_error(x, p, y) -> float:
    want = gguf_linear_ref(x, p, None).float()
    scale = x.float().abs() @ dequantize_gguf(p).abs().t()
    return ((y.float() - want).abs() / scale.clamp(min=1e-30)).max().item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--ms", default="1,16,256,512,2048")
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--warm-only", action="store_true")
    args = parser.parse_args()
    names, ms = args.formats.split(","), [int(m) for m in args.ms.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    torch.manual_seed(0)
    if not args.warm_only:
        bw, rate = measure_ceilings("cuda")
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: copy bandwidth {bw / 1e12:.2f} TB/s, "
              f"bf16 matmul {rate / 1e12:.0f} TFLOP/s")
        print("| format | N x K | M | us | floor us | of floor | bf16 F.linear us | vs bf16 | config | max err |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for n, k in shapes:
        xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in ms}
        peer = {}
        if not args.warm_only:
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies_for(2 * n * k))]
            peer = {m: graph_us([lambda w=w, x=xs[m]: F.linear(x, w) for w in ws]) for m in ms}
            del ws
        for name in names:
            packs = random_packed(name, n, k, 1 if args.warm_only else copies_for(packed_nbytes_of(name, n, k)))
            for m in ms:
                x = xs[m]
                cfgs = (SWEEP[min(SWEEP, key=lambda b: abs(b - m))] if args.sweep
                        else [_pick_config(m, name, torch.device("cuda"))])
                linear = lambda p, x=x: F.linear(x, dequantize_gguf_triton(p, x.dtype))  # noqa: E731
                dequantizes = m >= DEQUANTIZE_ROWS  # gguf_linear's path at this M on a GPU
                if args.warm_only:
                    for cfg in cfgs:
                        _launch(x, packs[0], None, cfg)
                    if m >= DEQUANTIZE_FROM:
                        linear(packs[0])
                    continue
                ref_us = graph_us([lambda p=p, x=x: gguf_linear_ref(x, p, None) for p in packs[:2]], per_graph=4)
                print(f"| {name} | {n}x{k} | {m} | {ref_us:.1f} | | | {peer[m]:.1f} | {ref_us / peer[m]:.2f}x | "
                      f"torch: dequantize_gguf + F.linear | |", flush=True)
                floor = (packed_nbytes(packs[0]) + 2 * m * (k + n)) / bw * 1e6 + 2 * m * n * k / rate * 1e6
                for cfg in cfgs:
                    us = graph_us([lambda p=p, x=x, cfg=cfg: _launch(x, p, None, cfg) for p in packs])
                    err = max_rel_error(x, packs[0], _launch(x, packs[0], None, cfg))
                    tag = "gemv" if cfg.gemv else "mm"
                    cfg_s = (f"{tag} n{cfg.block_n} m{cfg.block_m} u{cfg.units} w{cfg.num_warps} "
                             f"s{cfg.num_stages} k{cfg.split_k}{'' if cfg.x_once else ' xb'}"
                             f"{'' if args.sweep or dequantizes else ' (gguf_linear)'}")
                    print(f"| {name} | {n}x{k} | {m} | {us:.1f} | {floor:.1f} | {floor / us:.2f} | {peer[m]:.1f} | "
                          f"{us / peer[m]:.2f}x | {cfg_s} | {err:.1e} |", flush=True)
                if m >= DEQUANTIZE_FROM:
                    us = graph_us([lambda p=p: linear(p) for p in packs])
                    dq_us = graph_us([lambda p=p: dequantize_gguf_triton(p, x.dtype) for p in packs])
                    err = max_rel_error(x, packs[0], linear(packs[0]))
                    print(f"| {name} | {n}x{k} | {m} | {us:.1f} | {floor:.1f} | {floor / us:.2f} | {peer[m]:.1f} | "
                          f"{us / peer[m]:.2f}x | dequantize ({dq_us:.1f} us) + cuBLAS"
                          f"{' (gguf_linear)' if dequantizes else ''} | {err:.1e} |", flush=True)
            del packs
    torch.cuda.synchronize()


def packed_nbytes_of(name: str, n: int, k: int) -> int:
    fmt = FORMATS[name]
    return n * k // fmt.block * fmt.size


if __name__ == "__main__":
    main()
