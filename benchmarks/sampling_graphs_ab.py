"""Decode steps with the sampling graphs on and off, alternating in one process (Qwen3-0.6B shape).

    python3 benchmarks/sampling_graphs_ab.py 1x1024 8x1024 8x4096 64x1024   (BATCHxCONTEXT points)

For each point, `batch` requests (temperature 0.6) are prefilled and then timed over overlapped
decode steps, three times with the decode steps sampled in their graphs (StepGraphs.run_sampled) and
three times eagerly from the same process's graphs, alternating; ms a step. Both sides share one
process because a few-row step's time follows its process's host speed, which differs from process to
process by more than the difference measured here (HEADRACE_SAMPLING_GRAPHS=0 gives the other side a
process of its own).
"""
from __future__ import annotations

import gc
import random
import sys
import time

import torch

STEPS = 48


def main() -> None:
    from benchmarks_common import qwen3_06b_checkpoint
    from headrace.config import EngineArgs
    from headrace.core.engine import EngineCore
    from headrace.sampling_params import SamplingParams

    model = str(qwen3_06b_checkpoint())
    for point in sys.argv[1:] or ["1x1024", "8x1024"]:
        batch, context = map(int, point.split("x"))
        core = EngineCore(EngineArgs(model=model, device="cuda", max_num_seqs=batch, max_model_len=context,
                                     enable_prefix_caching=False, num_kv_blocks=batch * (-(-context // 16))))
        rng = random.Random(0)
        room = 8 * STEPS + 64  # no request finishes during the timed steps
        sp = SamplingParams(temperature=0.6, max_tokens=room, ignore_eos=True)
        for i in range(batch):
            core.add_request(str(i), [rng.randrange(3, 10000) for _ in range(context - room)], sp, time.time())
        while core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                            for r in core.scheduler.running):
            core.step()
        graphs = core.executor.graphs
        takes = graphs.samples
        ms = {"on": [], "off": []}
        for _ in range(3):
            for mode in ("on", "off"):
                graphs.samples = takes if mode == "on" else (lambda batch: False)
                for _ in range(4):
                    core.step()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(STEPS):
                    core.step()
                torch.cuda.synchronize()
                ms[mode].append((time.perf_counter() - t0) / STEPS * 1e3)
        print(f"{batch:4d}x{context:<5d} sampling graphs on: " + " ".join(f"{x:.3f}" for x in ms["on"])
              + "   off: " + " ".join(f"{x:.3f}" for x in ms["off"]) + " ms", flush=True)
        del core, graphs
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
