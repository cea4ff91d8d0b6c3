"""Where tensor parallelism's time goes: all-reduce cost by message size, and
decode steps at several batch sizes with one GPU against two.

    python3 benchmarks/tp_step.py [--configs tp1,tp2-nccl,tp2,engine-tp2] [--batches 1,16,256]
                                  [--context 1024] [--model DIR] [--no-sweep]

Default model: the Qwen3-8B shape with random bf16 weights (parallel.py's).
- sweep: one process per GPU; a bfloat16 all-reduce of each size through
  NCCL and through peer memory (executor/all_reduce.py), checked equal,
  each timed as 50 calls captured in one CUDA graph (as the engine runs
  them), median of 5 replays.
- tp1, tp2-nccl, tp2: an EngineCore per GPU process whose ModelRunner is
  one rank of the group (tp2-nccl: disable_custom_all_reduce), every rank
  stepping the same requests in lockstep, so there is no core-to-worker
  messaging: the steps' GPU work alone. At each batch size, `batch`
  requests of context - 64 prompt tokens are prefilled, then decode steps
  timed (overlapped scheduling, synchronised at both ends), then profiled
  on rank 0: GPU time a step by kernel kind and the GPU's idle share.
- engine-tp2: EngineCore(tensor_parallel_size=2) in this process driving
  two worker processes, as users run it: the same steps' time with the
  messaging to the workers included.
Floor: StepFloor's (every weight and cached KV byte read once, the FLOPs at
the measured rate), divided over the ranks; all-reduces are not counted.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from headrace.executor.all_reduce import NO_MULTICAST_ENV

SWEEP_BYTES = [8 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20, 8 << 20, 32 << 20]
KINDS = ("all-reduce", "all-gather", "matmul", "attention", "other")


def kernel_kind(name: str) -> str:
    n = name.lower()
    if "allreduce" in n or "all_reduce" in n:
        return "all-reduce"
    if "allgather" in n or "all_gather" in n:
        return "all-gather"
    # cuBLAS's GEMMs, and this project's Triton projections (kernels/dense.py, fp8.py, int4*.py, gguf.py)
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "splitk", "_dense_kernel", "_fp8_mm",
                            "_fp8_few_rows", "_int4_linear", "_int4_gemv", "_gguf_gemv", "_gguf_mm")):
        return "matmul"
    if any(k in n for k in ("attention", "attn", "_paged_decode")):  # the decode kernel and its split reduce too
        return "attention"
    return "other"


def graph_time(fn, calls: int = 50, replays: int = 5) -> float:
    """Seconds a call of fn, captured `calls` times in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def sweep(group, rank: int, device: torch.device) -> list[dict]:
    import torch.distributed as dist

    from headrace.executor.all_reduce import PeerAllReduce

    peer = PeerAllReduce(group.group, device, torch.bfloat16, max(SWEEP_BYTES))
    rows = []
    for nbytes in SWEEP_BYTES:
        gen = torch.Generator(device=device).manual_seed(rank * 1000 + nbytes)
        x = torch.randn(nbytes // 2, generator=gen, device=device).to(torch.bfloat16)
        want = x.clone()
        dist.all_reduce(want, group=group.group)
        got = peer(x)
        ok = bool(torch.equal(got, want))
        scratch = x.clone()
        nccl = graph_time(lambda: dist.all_reduce(scratch, group=group.group))
        fast = graph_time(lambda: peer(x))
        rows.append({"bytes": nbytes, "nccl_us": nccl * 1e6, "peer_us": fast * 1e6, "equal": ok})
    return rows


def run_points(core, args, rank: int, ceilings, tp: int) -> list[dict]:
    from benchmarks_common import StepFloor, gpu_busy

    from headrace.sampling_params import SamplingParams

    floor = StepFloor(core, *ceilings)
    results = []
    for batch in map(int, args.batches.split(",")):
        rng = random.Random(batch)
        sp = SamplingParams(temperature=0.6, max_tokens=64 + 2 * args.steps, ignore_eos=True, seed=1)
        for i in range(batch):
            core.add_request(f"{batch}-{i}", [rng.randrange(3, 10000) for _ in range(args.context - 64)], sp,
                             time.time())
        sched = core.scheduler
        while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
            core.step()
        for _ in range(3):
            core.step()
        cached = sum(r.num_expected for r in core.scheduler.running) + batch * args.steps // 2
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            core.step()
        torch.cuda.synchronize()
        step_s = (time.perf_counter() - t0) / args.steps
        t_bytes, t_flops = floor.seconds(1, cached, batch, batch, cached)
        row = {"batch": batch, "step_ms": step_s * 1e3, "floor_ms": (t_bytes + t_flops) / tp * 1e3}
        if rank == 0 and core.executor.__class__.__name__ == "ModelRunner":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    core.step()
                torch.cuda.synchronize()
            kinds = dict.fromkeys(KINDS, 0.0)
            for e in prof.key_averages():
                t = getattr(e, "self_device_time_total", None)
                t = e.self_cuda_time_total if t is None else t
                kinds[kernel_kind(e.key)] += t / args.steps / 1e3  # ms a step
            busy, wall = gpu_busy(prof)
            row.update({"kinds_ms": kinds, "idle": 1 - busy / wall if wall else 0.0})
            if batch == max(map(int, args.batches.split(","))):
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12,
                                                max_name_column_width=70), file=sys.stderr)
        else:
            for _ in range(args.steps):
                core.step()
        while core.has_unfinished:
            core.step()
        results.append(row)
    return results


def engine_args(args, **extra):
    from headrace.config import EngineArgs

    blocks_per_req = -(-(args.context + 64 + 2 * args.steps) // 16)
    batch = max(map(int, args.batches.split(",")))
    return EngineArgs(model=args.model, max_num_seqs=batch, max_model_len=blocks_per_req * 16,
                      num_kv_blocks=batch * blocks_per_req, enable_prefix_caching=False, **extra)


def worker(args) -> None:
    """One rank: args.rank of args.size, config args.config; rank 0 prints JSON."""
    from benchmarks_common import measure_ceilings

    from headrace.core import engine as engine_mod
    from headrace.executor.all_reduce import PEER_MAX_BYTES
    from headrace.executor.model_runner import ModelRunner
    from headrace.executor.parallel import init_group

    device = torch.device(f"cuda:{args.rank}")
    torch.cuda.set_device(device)
    peer = 0 if args.config in ("tp2-nccl", "sweep") else PEER_MAX_BYTES
    group = init_group(args.rank, args.size, args.rendezvous, device, torch.bfloat16, peer)
    out = {}
    if args.config == "sweep":
        out["sweep"] = sweep(group, args.rank, device)
    else:
        ceilings = measure_ceilings(device)
        engine_mod.ModelRunner = functools.partial(ModelRunner, tp=group)
        t0 = time.perf_counter()
        core = engine_mod.EngineCore(engine_args(args, device=f"cuda:{args.rank}"))
        out["start_s"] = time.perf_counter() - t0
        out["points"] = run_points(core, args, args.rank, ceilings, args.size)
        core.close()
    if args.rank == 0:
        print(json.dumps(out), flush=True)


def launch(args, config: str, size: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, __file__, "--worker", "--config", config, "--size", str(size), "--rendezvous",
               f"{d}/rendezvous", "--model", args.model, "--batches", args.batches, "--context", str(args.context),
               "--steps", str(args.steps)]
        env = os.environ | NO_MULTICAST_ENV
        procs = [subprocess.Popen(cmd + ["--rank", str(r)], stdout=subprocess.PIPE, text=True, env=env)
                 for r in range(size)]
        outs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{config}: exit codes {[p.returncode for p in procs]}")
        return json.loads(outs[0].strip().splitlines()[-1])


def engine_tp2(args) -> dict:
    from benchmarks_common import measure_ceilings

    from headrace.core.engine import EngineCore

    ceilings = measure_ceilings(torch.device("cuda"))
    t0 = time.perf_counter()
    core = EngineCore(engine_args(args, device="cuda", tensor_parallel_size=2))
    start = time.perf_counter() - t0
    try:
        return {"start_s": start, "points": run_points(core, args, 0, ceilings, 2)}
    finally:
        core.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="tp1,tp2-nccl,tp2,engine-tp2")
    parser.add_argument("--batches", default="1,16,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--model", default=None)
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--rendezvous", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    os.environ.update(NO_MULTICAST_ENV)
    from benchmarks_common import qwen3_8b_checkpoint

    if torch.cuda.device_count() < 2:
        parser.error(f"needs two GPUs; this machine has {torch.cuda.device_count()}")
    args.model = args.model or str(qwen3_8b_checkpoint())
    print(f"model {args.model} on {torch.cuda.get_device_name()}, context {args.context}")
    if not args.no_sweep:
        try:
            rows = launch(args, "sweep", 2)["sweep"]
        except Exception as e:
            print(f"sweep: failed: {type(e).__name__}: {e}", flush=True)
            rows = []
        print("| message | NCCL us | peer memory us | equal |\n| ---: | ---: | ---: | --- |")
        for r in rows:
            print(f"| {r['bytes'] >> 10} KiB | {r['nccl_us']:.1f} | {r['peer_us']:.1f} | {r['equal']} |", flush=True)
    results = {}
    for config in args.configs.split(","):
        try:
            if config == "engine-tp2":
                results[config] = engine_tp2(args)
            else:
                results[config] = launch(args, config, 1 if config == "tp1" else 2)
        except Exception as e:  # report it and go on to the next configuration
            print(f"{config}: failed: {type(e).__name__}: {e}", flush=True)
            continue
        print(f"{config}: engine ready in {results[config]['start_s']:.1f} s", flush=True)
    print("\n| config | batch | step ms | floor ms | x floor | " + " | ".join(f"{k} ms" for k in KINDS)
          + " | GPU idle |")
    print("| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in KINDS) + " | ---: |")
    for config, r in results.items():
        for p in r["points"]:
            kinds = p.get("kinds_ms")
            cols = " | ".join(f"{kinds[k]:.3f}" for k in KINDS) if kinds else " | ".join("-" for _ in KINDS)
            idle = f"{100 * p['idle']:.1f}%" if kinds else "-"
            print(f"| {config} | {p['batch']} | {p['step_ms']:.3f} | {p['floor_ms']:.3f} | "
                  f"{p['step_ms'] / p['floor_ms']:.2f} | {cols} | {idle} |")


if __name__ == "__main__":
    main()
