"""Graph and eager decode agree at long contexts, and what each step costs.

    python3 benchmarks/graph_check.py   (GPU)
"""
from __future__ import annotations

import random
import statistics
import time

import torch

from benchmarks_common import qwen3_06b_checkpoint
from headrace.config import EngineArgs
from headrace.core.engine import EngineCore
from headrace.core.protocol import unpack_floats
from headrace.sampling_params import SamplingParams


def run(enforce_eager: bool, batch: int, context: int):
    core = EngineCore(EngineArgs(model=str(qwen3_06b_checkpoint()), device="cuda", max_num_seqs=batch,
                                 max_model_len=context, enable_prefix_caching=False, enforce_eager=enforce_eager,
                                 num_kv_blocks=batch * (context // 16)))
    rng = random.Random(0)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    for i in range(batch):
        core.add_request(str(i), [rng.randrange(3, 10000) for _ in range(context - 9)], sp, time.time())
    lps, times = {}, []  # request id -> its sampled tokens' logprobs, in order
    while core.has_unfinished:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = core.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        for o in outs:
            if o.logprobs:
                lps.setdefault(o.request_id, []).append(float(unpack_floats(o.logprobs)[0]))
    return lps, statistics.median(times[-6:])


for batch, context in ((8, 1024), (64, 2048)):
    a, ta = run(False, batch, context)
    b, tb = run(True, batch, context)
    assert a.keys() == b.keys() and all(len(a[r]) == len(b[r]) for r in a)
    diff = max(abs(x - y) for r in a for x, y in zip(a[r], b[r]))  # position by position
    print(f"batch {batch} context {context}: graph step {ta * 1e3:.2f} ms, eager {tb * 1e3:.2f} ms, "
          f"max logprob diff {diff:.2e}, n={sum(map(len, a.values()))}")
