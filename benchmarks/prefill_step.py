"""What one new prompt costs the requests already decoding: the time of the
step that prefills it next to a running decode batch, against that step's
floor and against a decode-only step.

    python3 benchmarks/prefill_step.py [--model DIR] [--batches 8,64] [--prompts 128,512,1024,3072]

Default model: the Qwen3-0.6B shape with random bf16 weights. For each
decode batch, `batch` requests with 512-token prompts are prefilled and
decode; then, for each prompt length, a new request arrives, the step that
prefills it (with the batch's decode tokens) is timed one step at a time
(synchronised), and the request is aborted again. The first such step of
each prompt length is reported apart (it may compile or autotune), then the
median of --repeats. --profile BATCHxPROMPT prints the kernels and the host
functions of that point's mixed steps.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def synced_step(core) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    core.step()
    sync()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--batches", default="8,64")
    parser.add_argument("--prompts", default="128,512,1024,3072")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to try the script (no floor)")
    parser.add_argument("--profile", default="", help="BATCHxPROMPT[,...]")
    args = parser.parse_args()

    from benchmarks_common import StepFloor, measure_ceilings, qwen3_06b_checkpoint
    from headrace.config import EngineArgs
    from headrace.core.engine import EngineCore
    from headrace.sampling_params import SamplingParams

    model = args.model or str(qwen3_06b_checkpoint())
    bw, rate = measure_ceilings(torch.device("cuda")) if args.device == "cuda" else (float("inf"), float("inf"))
    batches, prompts = [int(b) for b in args.batches.split(",")], [int(p) for p in args.prompts.split(",")]
    core = EngineCore(EngineArgs(model=model, device=args.device, max_num_seqs=max(batches) + 1, max_model_len=max(1024, max(prompts) + 16),
                                 enable_prefix_caching=False, async_scheduling=False))
    floor = StepFloor(core, bw, rate)
    vocab = min(10000, core.model_config.vocab_size)
    rng = random.Random(0)
    sp = SamplingParams(temperature=0.6, max_tokens=400, ignore_eos=True)  # outlives the run
    new_sp = SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True)
    print(f"measured: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s; "
          f"max_num_batched_tokens {core.scheduler.config.max_num_batched_tokens}")
    print(f"{'batch':>5} {'prompt':>6} {'decode ms':>9} {'mixed ms':>8} {'first ms':>8} {'floor ms':>8} {'x floor':>7}")
    running = 0
    for batch in batches:
        for i in range(running, batch):
            core.add_request(f"d{i}", [rng.randrange(3, vocab) for _ in range(512)], sp, time.time())
        running = batch
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running) or core.scheduler.waiting:
            core.step()
        decode = statistics.median(synced_step(core) for _ in range(8))
        for prompt in prompts:
            times = []
            for rep in range(args.repeats + 1):
                rid = f"p{batch}-{prompt}-{rep}"
                core.add_request(rid, [rng.randrange(3, vocab) for _ in range(prompt)], new_sp, time.time())
                cached = sum(r.num_computed_tokens for r in core.scheduler.running)
                profiling = rep == args.repeats and f"{batch}x{prompt}" in args.profile.split(",")
                times.append(profiled_step(core) if profiling else synced_step(core))
                core.abort([rid])
                synced_step(core)  # a decode step, to leave the batch as it was
            new = min(prompt, core.scheduler.config.max_num_batched_tokens - batch)
            t_bytes, t_flops = floor.seconds(1, cached + batch + new, batch + new, batch + 1,
                                             cached + batch + new * (new + 1) // 2)
            mixed = statistics.median(times[1:])
            print(f"{batch:>5} {prompt:>6} {decode * 1e3:9.3f} {mixed * 1e3:8.3f} {times[0] * 1e3:8.3f} "
                  f"{(t_bytes + t_flops) * 1e3:8.3f} {mixed / max(t_bytes + t_flops, 1e-12):7.2f}")


def profiled_step(core) -> float:
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    host = cProfile.Profile()
    with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        host.enable()
        seconds = synced_step(core)
        host.disable()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    pstats.Stats(host).sort_stats("cumulative").print_stats(20)
    return seconds


if __name__ == "__main__":
    main()
