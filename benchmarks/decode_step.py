"""One decode step at several batch sizes and context lengths, against its floor.

    python3 benchmarks/decode_step.py [--model DIR] [--batches 1,8,64,256] [--contexts 128,1024,4096]

Default model: the Qwen3-0.6B shape with random bf16 weights (see
logprobs_cost.py). For each (batch, context) whose KV cache fits, `batch`
requests with `context - 64` prompt tokens are prefilled (so that none
finishes before the timed steps), then decode steps are timed. The floor
(benchmarks_common.StepFloor) is the time to read every weight and every
cached KV byte once at the measured device-to-device copy bandwidth, plus
the step's matmul and attention FLOPs at the measured bf16 matmul rate;
both ceilings are measured in the same run.
Steps are timed in a row, synchronised only at both ends, with overlapped
scheduling and then one step at a time; the GPU's idle time between the
overlapped steps comes from CUDA events around each queued step.
"""
from __future__ import annotations

import argparse
import gc
import random
import time

import torch


def timed_steps(core, steps: int) -> float:
    """Seconds per step over `steps` consecutive steps, synchronised only at both ends."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def profile(core, steps: int) -> None:
    """Where a decode step's time goes: GPU time per kernel (torch profiler,
    CUDA activity only) and host time per function (cProfile)."""
    import cProfile
    import pstats

    from benchmarks_common import gpu_busy

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed_steps(core, steps)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    busy, wall = gpu_busy(prof)
    print(f"GPU busy {busy / steps * 1e3:.3f} ms a step, idle {100 * (1 - busy / wall):.1f}% of the profiled wall time")
    prof_host = cProfile.Profile()
    prof_host.enable()
    timed_steps(core, steps)
    prof_host.disable()
    pstats.Stats(prof_host).sort_stats("tottime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--contexts", default="128,1024,4096")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--profile", default="", help="BATCHxCONTEXT[,...]: profile those points' decode steps")
    args = parser.parse_args()

    from benchmarks_common import StepFloor, StepTimeline, measure_ceilings, qwen3_06b_checkpoint
    from headrace.checkpoint.config import ModelConfig
    from headrace.config import EngineArgs
    from headrace.core.engine import EngineCore
    from headrace.sampling_params import SamplingParams

    model = args.model or str(qwen3_06b_checkpoint())
    cfg = ModelConfig.from_dir(model)
    device = torch.device("cuda")
    bw, rate = measure_ceilings(device)
    print(f"measured: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # bf16
    free, _ = torch.cuda.mem_get_info()
    print("step ms: steady state with overlapped scheduling, and one step at a time; idle: GPU idle between")
    print("steps with overlap, as a share of wall time")
    print(f"{'batch':>5} {'context':>7} {'step ms':>8} {'1-by-1':>8} {'floor ms':>8} {'x floor':>7} {'idle':>7}  bound")
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            if batch * context * kv_per_token > 0.8 * free:
                print(f"{batch:>5} {context:>7}   (KV cache does not fit)")
                continue
            core = EngineCore(EngineArgs(model=model, device="cuda", max_num_seqs=batch,
                                         max_model_len=context, enable_prefix_caching=False,
                                         num_kv_blocks=batch * (-(-context // 16))))
            step_floor = StepFloor(core, bw, rate)
            timeline = StepTimeline(core)
            rng = random.Random(0)
            # Requests whose prefill ends early decode while the others prefill:
            # leave them room (at least 64 tokens, and every prefill, timed or profiled step) so
            # that every row is still running, and decoding near `context`, in the timed steps.
            prefill_steps = -(-batch * context // core.sched_config.max_num_batched_tokens)
            room = max(64, (4 if args.profile else 2) * args.steps + 16 + prefill_steps)
            prompt_len = context - room
            sp = SamplingParams(temperature=0.6, max_tokens=room, ignore_eos=True)
            for i in range(batch):
                core.add_request(str(i), [rng.randrange(3, 10000) for _ in range(prompt_len)], sp, time.time())
            while core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                                for r in core.scheduler.running):
                core.step()  # prefill
            core.step()  # first decode step: warm
            core.step()
            assert len(core.scheduler.running) == batch, "a request finished before the timed steps"
            # KV read per step: the cached tokens, at the middle of the overlapped steps
            cached = sum(r.num_expected for r in core.scheduler.running) + batch * args.steps // 2
            timeline.reset()
            overlap = timed_steps(core, args.steps)
            idle, wall = timeline.idle()
            core.async_scheduling = False
            single = timed_steps(core, args.steps)
            core.async_scheduling = True
            assert len(core.scheduler.running) == batch
            # one decode token a row, each sampling and attending over its cached tokens
            t_bytes, t_flops = step_floor.seconds(1, cached, batch, batch, cached)
            floor = t_bytes + t_flops
            bound = "memory" if t_bytes > t_flops else "compute"
            print(f"{batch:>5} {context:>7} {overlap * 1e3:8.3f} {single * 1e3:8.3f} {floor * 1e3:8.3f} "
                  f"{overlap / floor:7.2f} {100 * idle / wall:6.1f}%  {bound}")
            if f"{batch}x{context}" in args.profile.split(","):
                profile(core, args.steps)
            # The timeline's wrapper and the executor refer to each other: collect
            # the cycle, or the next point's KV pool finds this one's still held.
            del core, timeline
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
