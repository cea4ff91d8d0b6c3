"""Data-parallel routing that uses the prefix cache, against least-loaded routing:
two cores, requests that share system prompts.

    python3 benchmarks/dp_routing.py [--routings least_loaded,prefix] [--num-requests 256]
        [--system-prompts 8] [--system-len 1000] [--user-len 50,200] [--max-tokens 128]
        [--num-kv-blocks N] [--device cuda] [--model DIR]

Workload (seed 0): --system-prompts prompts of --system-len random token ids
in [0, 10000) (modulo a smaller vocabulary), and --num-requests requests,
each one of them (in turn) followed by its own uniform [50, 200] random ids,
shuffled; temperature 0.6, ignore_eos, max_tokens 128, max_model_len
min(4096, the model's positions; the system prompts are cut to fit).
Each routing gets fresh cores (AsyncEngine.from_model, data_parallel_size=2,
prefix caching on, max_num_seqs = the number of requests, --num-kv-blocks
per core to put their caches under pressure), warmed up with the same
number of requests over other system prompts cut to 2 output tokens; then
all requests at once, one DELTA stream each. Figures: output tokens over
the wall time from the first submission to the last finish; the hit rate,
prompt tokens the cores served from their prefix caches
(RequestOutput.num_cached_tokens) over prompt tokens; median time to first
token; requests per core. The ceiling of the hit rate: every system prompt
computed once, each later request finding its full blocks (requests that
arrive together before their prefix is computed miss it, so a burst stays
below it).

Smoke run on a CPU: --model <tiny checkpoint dir> --device cpu --num-requests 32.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from benchmarks_common import qwen3_06b_checkpoint

from headrace import AsyncEngine, RequestOutputKind, SamplingParams
from headrace.checkpoint.config import ModelConfig
from headrace.frontend.router import ROUTING_MODES


def shared_prompts(args, seed: int, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """(system prompts, the requests' prompts in arrival order)."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(0, 10000) % vocab for _ in range(n)]

    systems = [ids(args.system_len) for _ in range(args.system_prompts)]
    lo, hi = args.user_len
    prompts = [systems[i % len(systems)] + ids(rng.randint(lo, hi)) for i in range(args.num_requests)]
    rng.shuffle(prompts)
    return systems, prompts


async def burst(engine: AsyncEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    sp = SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def one(prompt):
        state = await engine.add_request(prompt, sp)
        n = 0
        async for out in engine.outputs(state):
            n += len(out.outputs[0].token_ids)
        m = out.metrics  # the core's first-token time against the frontend's arrival time
        return state.core, n, out.num_cached_tokens or 0, m.first_token_time - m.arrival_time

    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(p) for p in prompts))
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": sum(d[1] for d in done), "cached": sum(d[2] for d in done),
            "ttft": statistics.median(d[3] for d in done), "per_core": [sum(d[0] == c for d in done) for c in (0, 1)]}


async def run_routing(args, routing: str, warmup: list[list[int]], prompts: list[list[int]]) -> dict:
    options = dict(device=args.device, max_model_len=args.max_model_len, max_num_seqs=args.num_requests,
                   enable_prefix_caching=True, num_kv_blocks=args.num_kv_blocks)
    async with AsyncEngine.from_model(args.model, data_parallel_size=2, routing=routing, **options) as engine:
        await burst(engine, warmup, 2)  # other system prompts: the caches stay cold for the timed prompts
        r = await burst(engine, prompts, args.max_tokens)
        r["block_size"] = engine.info.block_size
        return r


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--routings", default="least_loaded,prefix", help=f"comma-separated, of {ROUTING_MODES}")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument("--system-len", type=int, default=1000)
    parser.add_argument("--user-len", default="50,200", help="min,max tokens after the system prompt")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="per core (default: the device's budget)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default=None, help="default: the Qwen3-0.6B shape with random bf16 weights")
    args = parser.parse_args()
    routings = args.routings.split(",")
    if set(routings) - set(ROUTING_MODES):
        parser.error(f"unknown routings {sorted(set(routings) - set(ROUTING_MODES))}")
    args.user_len = tuple(int(x) for x in args.user_len.split(","))
    if len(args.user_len) != 2 or not 0 < args.user_len[0] <= args.user_len[1]:
        parser.error("--user-len takes min,max with 0 < min <= max")
    for name in ("num_requests", "system_prompts", "system_len", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    args.model = args.model or str(qwen3_06b_checkpoint())
    config = ModelConfig.from_dir(args.model)
    args.max_model_len = min(4096, config.max_position_embeddings)
    fits = args.max_model_len - args.user_len[1] - args.max_tokens
    if fits < 1:
        parser.error(f"max_model_len {args.max_model_len} leaves no room for a system prompt")
    if args.system_len > fits:
        print(f"system prompts cut to {fits} tokens to fit max_model_len {args.max_model_len}")
        args.system_len = fits
    systems, prompts = shared_prompts(args, 0, config.vocab_size)
    _, warmup = shared_prompts(args, 1, config.vocab_size)
    num_prompt = sum(map(len, prompts))
    print(f"{args.model} on {args.device}, data_parallel_size=2: {len(prompts)} requests over {len(systems)} system "
          f"prompts of {args.system_len} tokens, {num_prompt} prompt tokens, max_tokens {args.max_tokens}, "
          f"num_kv_blocks {args.num_kv_blocks or 'auto'} per core", flush=True)
    results = {}
    for routing in routings:
        results[routing] = r = asyncio.run(run_routing(args, routing, warmup, prompts))
        print(f"{routing}: {r['tokens'] / r['seconds']:.0f} output tok/s, hit rate {r['cached'] / num_prompt:.3f}",
              flush=True)
    bs = next(iter(results.values()))["block_size"]
    ceiling = (len(prompts) - len(systems)) * (args.system_len // bs * bs) / num_prompt
    print(f"| routing | output tok/s | prefix-cache hit rate (ceiling {ceiling:.3f}) | median TTFT (ms) "
          f"| requests per core |")
    print("| --- | ---: | ---: | ---: | --- |")
    for routing, r in results.items():
        print(f"| {routing} | {r['tokens'] / r['seconds']:.0f} | {r['cached'] / num_prompt:.3f} | "
              f"{r['ttft'] * 1e3:.0f} | {r['per_core'][0]} / {r['per_core'][1]} |")


if __name__ == "__main__":
    main()
