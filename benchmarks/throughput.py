"""Offline throughput on the small-engine community's workload, against its
floor and transformers' continuous batching.

    python3 benchmarks/throughput.py [--num-requests 256] [--peer-requests 32] [--model DIR]
                                     [--parts overlapped,serial,windows,peer] [--repeats 1] [--kernels]
                                     [--by-rows]

Workload: seed 0; prompts of uniform [100, 1024] random token ids in [0,
10000); max_tokens uniform [100, 1024]; temperature 0.6; ignore_eos;
max_model_len 4096; the Qwen3-0.6B shape with random bf16 weights.

The floor comes from the schedule the engine actually ran: every step
reads all weights once and each scheduled request's cached KV, at the
device-to-device copy bandwidth measured in this run, plus the step's
matmul and attention FLOPs at the measured bf16 matmul rate
(benchmarks_common.StepFloor: the LM head counts only for sampling rows).
The run is made with overlapped scheduling and again one step at a time,
with the GPU's idle time between steps from CUDA events around each queued
step, the garbage collector's pauses in the process over the run (the
heap alive at a run's start is frozen for the run, as LLM.generate does it,
and a spawned core for its whole life), and the Triton kernel variants that
were compiled or loaded from the cache during the run. The peer is transformers'
generate_batch on the first --peer-requests
requests (all with the same max_new_tokens, which generate_batch needs),
run by both engines. --parts picks among those four runs (the overlapped
one, one step at a time, the profiled windows of a rerun of the overlapped
one, the peer; windows needs overlapped); --repeats runs the
first two that many times in the same engine (the first run of a process also
pays first uses, such as Triton compiles for new shapes); --kernels adds one
more overlapped run under the torch profiler and prints its GPU time by
kernel (set HEADRACE_PDL=0 for kernel times that hold no wait for the kernel
ahead); --by-rows splits each overlapped run's steps by batch rows (decode
steps of 1-8, 9-32, 33-128 and more rows, and steps with a prefill chunk):
their GPU time (from the GPU reaching the step's first queued operation, so a
wait for the host's queuing within a step counts there), the time the GPU
waited for the host between steps, and their floor, to show where a run's
distance from its floor lies.
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks_common import (GcPauses, ScheduleRecorder, StepFloor, StepTimeline, by_rows, gpu_busy,
                               measure_ceilings, qwen3_06b_checkpoint, workload)
from headrace.config import EngineArgs
from headrace.core.engine import EngineCore
from headrace.kernels import compiled_variants
from headrace.lifetime import heap_frozen
from headrace.sampling_params import SamplingParams


def run_ours(core: EngineCore, prompts, max_tokens, windows=()):
    """(seconds, output tokens, [(busy, wall) GPU seconds per profiled window]):
    windows are (first step, number of steps) to run under the torch profiler."""
    t0 = time.perf_counter()
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        core.add_request(f"{time.monotonic_ns()}-{i}", p, SamplingParams(temperature=0.6, max_tokens=m,
                                                                          ignore_eos=True), time.time())
    starts, stops = dict(windows), {first + n: first for first, n in windows}
    out = step = 0
    prof, busy = None, []
    while core.has_unfinished:
        if step in starts:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.start()
        out += sum(len(o.new_token_ids) // 4 for o in core.step())
        step += 1
        if prof is not None and step in stops:
            torch.cuda.synchronize()
            prof.stop()
            busy.append(gpu_busy(prof))
            prof = None
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out, busy


def kernel_table(core: EngineCore, prompts, max_tokens) -> None:
    """One overlapped run under the torch profiler: GPU seconds by kernel, largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        elapsed, _, _ = run_ours(core, prompts, max_tokens)
    busy, wall = gpu_busy(prof)
    rows = sorted(((e.self_device_time_total, e.count, e.key) for e in prof.key_averages()
                   if e.self_device_time_total > 0), reverse=True)
    total = sum(r[0] for r in rows)
    print(f"by kernel (one run, {elapsed:.2f} s under the profiler; GPU busy {busy:.2f} of {wall:.2f} s):")
    for us, count, name in rows[:25]:
        print(f"  {us / 1e6:8.3f} s {100 * us / total:5.1f}% {count:8d} calls {us / count:8.1f} us  {name[:90]}")


def run_peer(model_dir: str, prompts, max_new_tokens: int) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, temperature=0.6, eos_token_id=None)
    t0 = time.perf_counter()
    with torch.no_grad():
        results = model.generate_batch(prompts, generation_config=cfg)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return elapsed, sum(len(r.generated_tokens) for r in results.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--peer-requests", type=int, default=32)
    parser.add_argument("--peer-max-tokens", type=int, default=256)
    parser.add_argument("--parts", default="overlapped,serial,windows,peer")
    parser.add_argument("--repeats", type=int, default=1, help="runs of the overlapped and serial parts")
    parser.add_argument("--kernels", action="store_true", help="GPU time by kernel over one overlapped run")
    parser.add_argument("--by-rows", action="store_true",
                        help="each overlapped run's steps by batch rows: GPU time, wait for the host, floor")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    unknown = parts - {"overlapped", "serial", "windows", "peer"}
    if unknown:
        parser.error(f"unknown --parts {sorted(unknown)}")
    if "windows" in parts and "overlapped" not in parts:
        parser.error("--parts windows needs overlapped (its windows are steps of the overlapped run)")
    if args.by_rows and "overlapped" not in parts:
        parser.error("--by-rows needs --parts overlapped (it splits the overlapped runs' steps)")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    model = args.model or str(qwen3_06b_checkpoint())
    bw, rate = measure_ceilings(torch.device("cuda"))
    # No prefix caching: the prompts share nothing, and repeated runs of the
    # same prompts must compute them again, as the peer does.
    core = EngineCore(EngineArgs(model=model, device="cuda", max_model_len=4096, max_num_seqs=256,
                                 enable_prefix_caching=False))
    step_floor = StepFloor(core, bw, rate)
    prompts, max_tokens = workload(args.num_requests)
    run_ours(core, prompts, [2] * len(prompts))  # warm-up: compiles the kernels for every prefill shape
    print(f"measured: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    timeline = StepTimeline(core)
    overlapped_steps = 0
    for overlap in [True] * args.repeats + [False] * args.repeats:
        if ("overlapped" if overlap else "serial") not in parts:
            continue
        core.async_scheduling = overlap
        rec = ScheduleRecorder(core)
        timeline.reset()
        variants = compiled_variants()
        with GcPauses() as collections, heap_frozen():  # as LLM.generate runs
            elapsed, out_tokens, _ = run_ours(core, prompts, max_tokens)
        new_variants = {k: n - variants.get(k, 0) for k, n in compiled_variants().items() if n > variants.get(k, 0)}
        torch.cuda.synchronize()  # the last step's end event (recorded after its outputs' event)
        idle, wall = timeline.idle()
        rec.detach()
        floor = sum(step_floor.seconds(rec.steps, rec.kv_tokens, rec.tokens, rec.sampled_rows, rec.pairs))
        overlapped_steps = overlapped_steps or rec.steps
        print(f"headrace ({'overlapped' if overlap else 'one step at a time'}): {out_tokens} output tokens in "
              f"{elapsed:.2f} s = {out_tokens / elapsed:.0f} tok/s; {rec.steps} steps; floor {floor:.2f} s = "
              f"{out_tokens / floor:.0f} tok/s; time / floor = {elapsed / floor:.2f}; "
              f"GPU idle between steps {100 * idle / wall:.1f}% of {wall:.2f} s; {collections.summary()}; "
              f"Triton variants compiled mid-run: {new_variants or 'none'}")
        if args.by_rows and overlap:
            print("\n".join("  " + line for line in by_rows(rec.per_step, timeline.spans(), step_floor)))
    core.async_scheduling = True
    if "windows" in parts:
        # A profiled rerun (the profiler slows the host): a window with every request
        # decoding, and one in the tail where few are left.
        windows = [(100, 50), (overlapped_steps - 150, 50)]
        _, _, busy = run_ours(core, prompts, max_tokens, windows=windows)
        for (first, n), (gpu, wall) in zip(windows, busy):
            print(f"  overlapped, steps {first}-{first + n - 1} under the profiler: GPU idle "
                  f"{100 * (1 - gpu / wall):.1f}% of {wall:.3f} s (between and within steps)")
    if args.kernels:
        kernel_table(core, prompts, max_tokens)
    if "peer" not in parts:
        return
    sub = prompts[: args.peer_requests]
    ours_t, ours_n, _ = run_ours(core, sub, [args.peer_max_tokens] * len(sub))
    try:
        peer_t, peer_n = run_peer(model, sub, args.peer_max_tokens)
    except Exception as e:  # the peer's own failure is reported, not hidden
        print(f"transformers generate_batch failed: {type(e).__name__}: {e}")
        return
    print(f"subset of {len(sub)} requests x {args.peer_max_tokens} tokens: headrace {ours_n / ours_t:.0f} tok/s, "
          f"transformers generate_batch {peer_n / peer_t:.0f} tok/s, ratio {(ours_n / ours_t) / (peer_n / peer_t):.1f}x")


if __name__ == "__main__":
    main()
