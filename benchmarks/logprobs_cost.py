"""What logprobs cost: decode throughput with logprobs=0, 5, 20 and with 128
logprob_token_ids, relative to none, on the same batch.

    python benchmarks/logprobs_cost.py [--model DIR | --qwen3-0.6b] [--batch 64] [--prompt-len 64]
                                       [--max-tokens 128] [--device auto] [--repeats 3]

--qwen3-0.6b builds (once, cached) a checkpoint of the Qwen3-0.6B shape
with random bf16 weights: hidden 1024, 28 layers, 16 query and 8 KV heads
of 128, intermediate 3072, vocabulary 151936, tied embeddings. The engine
core runs in this process (no sockets, no detokenization), all requests
are admitted at once, and each run is timed from admission to the last
token; the median of --repeats interleaved runs is printed.
"""
from __future__ import annotations

import argparse
import random
import time


def run_once(core, prompts, sp) -> float:
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(f"r{time.monotonic_ns()}-{i}", p, sp, time.time())
    tokens = 0
    while core.has_unfinished:
        tokens += sum(len(o.new_token_ids) // 4 for o in core.step())
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--qwen3-0.6b", dest="qwen", action="store_true")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from headrace.config import EngineArgs
    from headrace.core.engine import EngineCore
    from headrace.sampling_params import SamplingParams

    if args.qwen:
        from benchmarks_common import qwen3_06b_checkpoint

        args.model = str(qwen3_06b_checkpoint())
    elif args.model is None:
        from headrace.testing import demo_checkpoint

        args.model = str(demo_checkpoint())
    core = EngineCore(EngineArgs(model=args.model, device=args.device, max_num_seqs=args.batch,
                                 max_model_len=args.prompt_len + args.max_tokens + 8, enable_prefix_caching=False))
    vocab = core.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, min(vocab, 10000)) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    base = dict(temperature=0.6, max_tokens=args.max_tokens, ignore_eos=True, seed=1)
    cases = {
        "none": SamplingParams(**base),
        "logprobs=0": SamplingParams(**base, logprobs=0),
        "logprobs=5": SamplingParams(**base, logprobs=5),
        "logprobs=20": SamplingParams(**base, logprobs=20),
        "128 logprob_token_ids": SamplingParams(**base, logprob_token_ids=list(range(100, 228))),
    }
    run_once(core, prompts[:2], SamplingParams(**base, logprobs=5))  # warm-up
    runs = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, sp in cases.items():
            runs[name].append(run_once(core, prompts, sp))
    med = {name: sorted(r)[len(r) // 2] for name, r in runs.items()}
    print(f"{args.model}: batch {args.batch}, prompt {args.prompt_len}, {args.max_tokens} output tokens, "
          f"vocab {vocab}, device {core.executor.device}, median of {args.repeats}")
    for name, tps in med.items():
        print(f"{name:>24}: {tps:10.1f} output tokens/s  ({tps / med['none']:.3f} of none; "
              f"cost {1 - tps / med['none']:+.1%})")


if __name__ == "__main__":
    main()
