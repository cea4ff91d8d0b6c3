"""Past one GPU: the community workload on a Qwen3-8B-shaped model with random
bf16 weights, one GPU against two, each configuration against its floor.

    python3 benchmarks/parallel.py [--configs tp1,tp2,tp2-nccl,dp2] [--num-requests 256] [--max-output 1024] [--model DIR]

Workload as throughput.py's (benchmarks_common.workload: seed 0, prompts of
uniform [100, 1024] random token ids, max_tokens uniform [100, 1024],
temperature 0.6, ignore_eos, max_model_len 4096, no prefix caching,
max_num_seqs = the number of requests). Configurations:
- tp1: EngineCore in this process on one GPU; all requests added at once,
  step() until done (throughput.py's run), after a warm-up with the same
  requests cut to 2 output tokens.
- tp2: the same with tensor_parallel_size=2 (two worker processes; all-reduces
  through peer memory up to executor/all_reduce.PEER_MAX_BYTES, NCCL above).
- tp2-nccl: tp2 with disable_custom_all_reduce (every all-reduce through NCCL).
- dp2: AsyncEngine.from_model(data_parallel_size=2): two cores on one GPU
  each, all requests at once, one DELTA stream each, after the same warm-up.
Floors: tp1's is StepFloor over the schedule it executed (every weight read
once per step, each row's cached KV, at the measured copy bandwidth, plus
the matmul and attention FLOPs at the measured bf16 rate). Two GPUs split
that work, so tp2's floor is its own schedule's floor over 2 (the
all-reduces are not counted) and dp2's is tp1's over 2 (each core runs
about half the requests; their schedules are not visible from here).
"""
from __future__ import annotations

import argparse
import asyncio
import time

import torch

from benchmarks_common import ScheduleRecorder, StepFloor, measure_ceilings, qwen3_8b_checkpoint, workload
from throughput import run_ours

from headrace import AsyncEngine, RequestOutputKind, SamplingParams
from headrace.config import EngineArgs
from headrace.core.engine import EngineCore

CONFIGS = ("tp1", "tp2", "tp2-nccl", "dp2")


def engine_options(args) -> dict:
    return dict(device="cuda", max_model_len=4096, max_num_seqs=args.num_requests, enable_prefix_caching=False)


def in_process(args, config: str, prompts, max_tokens, ceilings) -> dict:
    tp = int(config[2])
    core = EngineCore(EngineArgs(model=args.model, tensor_parallel_size=tp, **engine_options(args),
                                 disable_custom_all_reduce=config.endswith("-nccl")))
    try:
        floor = StepFloor(core, *ceilings)
        run_ours(core, prompts, [2] * len(prompts))  # warm-up
        rec = ScheduleRecorder(core)
        seconds, tokens, _ = run_ours(core, prompts, max_tokens)
        rec.detach()
        floor_s = sum(floor.seconds(rec.steps, rec.kv_tokens, rec.tokens, rec.sampled_rows, rec.pairs)) / tp
        return {"config": config, "tokens": tokens, "seconds": seconds, "steps": rec.steps, "floor": floor_s}
    finally:
        core.close()


async def data_parallel(args, prompts, max_tokens) -> dict:
    async def one(engine, prompt, m):
        sp = SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        n = 0
        async for out in engine.generate(prompt, sp):
            n += len(out.outputs[0].token_ids)
        return n

    async with AsyncEngine.from_model(args.model, data_parallel_size=2, **engine_options(args)) as engine:
        await asyncio.gather(*(one(engine, p, 2) for p in prompts))  # warm-up
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(engine, p, m) for p, m in zip(prompts, max_tokens))))
        return {"config": "dp2", "tokens": tokens, "seconds": time.perf_counter() - t0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-output", type=int, default=1024, help="cut max_tokens to this (smoke runs)")
    parser.add_argument("--model", default=None, help="default: the Qwen3-8B shape with random bf16 weights")
    args = parser.parse_args()
    configs = args.configs.split(",")
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}")
    need = 2 if {"tp2", "tp2-nccl", "dp2"} & set(configs) else 1
    if torch.cuda.device_count() < need:
        parser.error(f"{args.configs} needs {need} GPUs; this machine has {torch.cuda.device_count()}")
    t0 = time.perf_counter()
    args.model = args.model or str(qwen3_8b_checkpoint())
    print(f"model {args.model} (ready in {time.perf_counter() - t0:.0f} s) on {torch.cuda.get_device_name()}")
    ceilings = measure_ceilings(torch.device("cuda"))
    print(f"measured: copy {ceilings[0] / 1e12:.2f} TB/s, bf16 matmul {ceilings[1] / 1e12:.0f} TFLOP/s (one GPU)")
    prompts, max_tokens = workload(args.num_requests)
    max_tokens = [min(m, args.max_output) for m in max_tokens]
    results = {}
    for config in configs:
        if config == "dp2":
            if "tp1" not in results:
                results["tp1"] = in_process(args, "tp1", prompts, max_tokens, ceilings)
            r = asyncio.run(data_parallel(args, prompts, max_tokens))
            r["floor"] = results["tp1"]["floor"] / 2
        else:
            r = in_process(args, config, prompts, max_tokens, ceilings)
        results[config] = r
    print("| config | output tok/s | floor tok/s | time / floor |")
    print("| --- | ---: | ---: | ---: |")
    for config in configs:
        r = results[config]
        print(f"| {config} | {r['tokens'] / r['seconds']:.0f} | {r['tokens'] / r['floor']:.0f} | "
              f"{r['seconds'] / r['floor']:.2f} |")


if __name__ == "__main__":
    main()
