"""Streaming throughput: AsyncEngine over ZeroMQ (1 and 2 frontend processes)
against the engine core driven in-process, on one workload.

    python benchmarks/streaming.py [--model DIR] [--num-requests 256] [--prompt-len 32]
                                   [--max-tokens 64] [--device auto]

Every path runs the same requests (seeded random prompts, ignore_eos, so
every run generates the same number of tokens). The in-process path calls
EngineCore.step() in a loop with no sockets and no detokenization; the ZMQ
paths stream DELTA outputs with incremental detokenization in the frontend
processes. Prints output tokens/s per path (median of --repeats interleaved
runs), the ratio to in-process, the steps taken and the share of wall time
the core spent inside steps (the rest is socket handling and waiting).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

from benchmarks_common import core_process, run_workers, worker_answer


def workload(n: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(n)]


def in_process(args, prompts) -> tuple[float, int, float]:
    from headrace.config import EngineArgs
    from headrace.core.engine import EngineCore
    from headrace.sampling_params import SamplingParams

    core = EngineCore(EngineArgs(model=args.model, device=args.device, max_num_seqs=args.num_requests))
    sp = SamplingParams(temperature=0.6, max_tokens=args.max_tokens, ignore_eos=True)
    _warm(lambda: core.add_request("warm", prompts[0], sp, time.time()), core)
    steps, busy = core.num_steps, core.step_seconds
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(str(i), p, sp, time.time())
    tokens = 0
    while core.has_unfinished:
        tokens += sum(len(o.new_token_ids) // 4 for o in core.step())
    elapsed = time.perf_counter() - t0
    return tokens / elapsed, core.num_steps - steps, (core.step_seconds - busy) / elapsed


def _warm(add, core) -> None:
    add()
    while core.has_unfinished:
        core.step()


async def core_stats(address: str):
    from headrace import AsyncEngine

    async with AsyncEngine.connect(address) as engine:
        return await engine.stats()


async def frontend(address: str, prompts, max_tokens: int) -> int:
    from headrace import AsyncEngine, RequestOutputKind, SamplingParams

    sp = SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    async with AsyncEngine.connect(address) as engine:
        async def one(p):
            n = 0
            async for out in engine.generate(p, sp):
                n += len(out.outputs[0].token_ids)
            return n

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


def over_zmq(args, prompts, num_frontends: int) -> tuple[float, int, float]:
    from headrace.frontend.async_engine import run

    with core_process(args.model, args.device, "--max-num-seqs", str(args.num_requests)) as address:
        run(frontend(address, prompts[:1], 4))  # warm-up
        before = run(core_stats(address))
        shards = [prompts[i::num_frontends] for i in range(num_frontends)]
        cmd = [sys.executable, __file__, "--frontend", address, "--max-tokens", str(args.max_tokens)]
        elapsed, tokens = run_workers(cmd, shards)
        after = run(core_stats(address))
    busy = (after.step_seconds - before.step_seconds) / elapsed
    return sum(tokens) / elapsed, after.num_steps - before.num_steps, busy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each path; the median is printed")
    parser.add_argument("--frontend", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.frontend:  # a frontend process (benchmarks_common.run_workers): prompts, ready, go, tokens received
        from headrace.frontend.async_engine import run  # import everything before timing starts

        prompts = json.loads(sys.stdin.readline())
        print("ready", flush=True)
        sys.stdin.readline()
        worker_answer(run(frontend(args.frontend, prompts, args.max_tokens)))
        return
    if args.model is None:
        from headrace.testing import demo_checkpoint

        args.model = str(demo_checkpoint())
    from headrace.checkpoint.config import ModelConfig

    vocab = ModelConfig.from_dir(args.model).vocab_size
    prompts = workload(args.num_requests, args.prompt_len, vocab)
    paths = {
        "in-process": lambda: in_process(args, prompts),
        "zmq, 1 frontend": lambda: over_zmq(args, prompts, 1),
        "zmq, 2 frontends": lambda: over_zmq(args, prompts, 2),
    }
    runs = {name: [] for name in paths}
    for _ in range(args.repeats):  # interleaved, so drifts in machine speed hit every path alike
        for name, path in paths.items():
            runs[name].append(path())
    results = {name: sorted(r)[len(r) // 2] for name, r in runs.items()}  # median by tokens/s
    base = results["in-process"][0]
    print(f"{args.num_requests} streams, prompt {args.prompt_len}, {args.max_tokens} output tokens each; "
          f"median of {args.repeats} (all runs, tokens/s: " +
          "; ".join(f"{n}: {', '.join(f'{r[0]:.0f}' for r in rs)}" for n, rs in runs.items()) + ")")
    for name, (tps, steps, busy) in results.items():
        print(f"{name:>20}: {tps:10.1f} output tokens/s  ({tps / base:.3f} of in-process)  "
              f"{steps} steps, core busy {busy:.0%} of the time")


if __name__ == "__main__":
    main()
