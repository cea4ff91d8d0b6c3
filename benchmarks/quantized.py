"""Quantized weights on a GPU: the memory they save and the speed they give.

    python3 benchmarks/quantized.py [--parts memory,decode,community,gguf] [--formats bf16,fp8,int4,int4-head]
                                    [--quantize-embeddings] [--num-requests 64] [--batches 1,16] [--profile 1,16]
                                    [--by-rows] [--kernels]

Formats, on the Qwen3-8B shape with random weights (benchmarks_common.qwen3_8b_checkpoint):
bf16 as stored; fp8 (quantization="fp8": E4M3 weights quantized at load, per
output channel); int4 (a GPTQ checkpoint of random 4-bit weights, group 128,
symmetric, written once by write_gptq next to the bf16 one); int4-head (the
same with the LM head in GPTQ 4-bit too, quantization_config.lm_head). With
--quantize-embeddings, the quantized formats also run again as fp8+emb,
int4+emb and int4-head+emb (quantize_embeddings=True: the embedding table
and LM head in FP8, one scale per row; int4-head keeps its 4-bit LM head) in
the memory and decode parts.
  memory     weight bytes the engine holds on the GPU (parameters, buffers,
             GGUF blocks): all of them and the decoder projections alone, each
             against bf16, and the embedding table with the LM head (one table
             when tied); and what the engine allocated, less its KV cache.
  decode     one decode step at batch 1 and 16 (--batches), context 1024 (as decode_step.py),
             against the format's own floor: the weights a step reads as held
             (all but the embedding table, a lookup; the LM head is read whole)
             and the cached KV at the measured copy bandwidth, plus the matmul
             and attention FLOPs at the measured bf16 matmul rate. --profile
             BATCH[,...] then prints where those batches' steps spend their time
             (GPU time per kernel, host time per function; decode_step.profile).
  community  benchmarks_common.workload of --num-requests requests (temperature
             0.6, ignore_eos, max_model_len 4096) in bf16 and fp8 (int4 is left
             out to keep the run short): output tokens/s, and time over the floor
             of the schedule the engine ran. --by-rows splits each format's run
             by the steps' batch rows (as throughput.py --by-rows); --kernels
             runs it once more under the profiler: GPU time by kernel.
  gguf       the SmolLM2-135M-Instruct Q4_1 file on the GPU, its blocks packed
             (the default) and dequantized to bf16 at load: weight memory,
             single-stream decode tokens/s (a 256-token greedy generation less
             a 1-token one, medians of 3), and on the CLI's demo prompts the
             first token where the two greedy 64-token outputs differ.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import random
import re
import shutil
import statistics
import time
from pathlib import Path

import torch

PARTS = ("memory", "decode", "community", "gguf")
FORMATS = ("bf16", "fp8", "int4", "int4-head")
QUANTIZATION = {"bf16": None, "fp8": "fp8", "int4": "gptq", "int4-head": "gptq"}
# A decoder projection's float weight in a Hugging Face checkpoint.
PROJECTION = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
GiB = 2**30


def write_gptq(src: Path, dst: Path, group_size: int = 128, lm_head: bool = False, seed: int = 0) -> Path:
    """dst: the checkpoint src with each decoder projection (and with lm_head,
    the LM head: quantization_config.lm_head) replaced by random GPTQ 4-bit
    weights (random bits, zero point 8, fp16 scales around 0.02 / 4.6 so that
    the dequantized weights have a std near 0.02, as src's), written shard by
    shard; every other tensor and file as in src. Built once, in dst.part
    renamed to dst when complete."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if dst.is_dir():
        return dst
    work = dst.with_name(dst.name + ".part")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, work / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                                     "desc_act": False, "sym": True, "checkpoint_format": "gptq", "lm_head": lm_head}
    (work / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(seed)
    scale = 0.02 / 21.5**0.5  # q - 8, q uniform over 0..15, has an rms of sqrt(21.5)
    weight_map = {}
    for file in sorted(src.glob("*.safetensors")):
        shard = {}
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if not (PROJECTION.search(name) or lm_head and name == "lm_head.weight"):
                    shard[name] = f.get_tensor(name)
                    continue
                out, k = f.get_slice(name).get_shape()
                if k % group_size or k % 8 or out % 8:
                    raise ValueError(f"{name} [{out}, {k}] does not split into groups of {group_size}")
                stem, groups = name.removesuffix(".weight"), k // group_size
                shard[f"{stem}.qweight"] = torch.randint(-2**31, 2**31, (k // 8, out), dtype=torch.int32,
                                                         generator=gen)
                shard[f"{stem}.qzeros"] = torch.full((groups, out // 8), 0x77777777, dtype=torch.int32)  # 8 - 1
                shard[f"{stem}.scales"] = (torch.empty(groups, out).uniform_(0.9, 1.1, generator=gen) * scale).half()
                shard[f"{stem}.g_idx"] = (torch.arange(k, dtype=torch.int32) // group_size)
        save_file(shard, str(work / file.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file.name))
    if (src / "model.safetensors.index.json").exists():
        (work / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    work.rename(dst)
    return dst


def qwen3_8b_gptq(lm_head: bool = False) -> Path:
    from benchmarks_common import qwen3_8b_checkpoint
    from headrace import envs

    name = "qwen3-8b-random-gptq" + ("-head" if lm_head else "")
    return write_gptq(qwen3_8b_checkpoint(), envs.cache_dir() / name, lm_head=lm_head)


def held_bytes(model) -> dict[str, int]:
    """Bytes of weights a model holds on its device, by role: the decoder's
    "projections", the "embedding" table, the "lm_head" (0 when tied) and
    "other" (norms); each storage counted once."""
    from headrace.executor.models.quant import PROJECTIONS
    from headrace.kernels.gguf import PackedGGUF

    seen, sizes = set(), dict.fromkeys(("projections", "embedding", "lm_head", "other"), 0)
    for path, module in model.named_modules():
        names = path.split(".")
        role = ("projections" if any(p in names for p in PROJECTIONS) else "embedding" if "embed_tokens" in names
                else "lm_head" if "lm_head" in names else "other")
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        for part in getattr(module, "parts", None) or ():  # GGUFLinear's packed blocks or float parts
            tensors += part.tensors() if isinstance(part, PackedGGUF) else [part]
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                sizes[role] += storage.nbytes()
    return sizes


def step_read_bytes(sizes: dict[str, int]) -> int:
    """Weight bytes one decode step reads: all but the embedding table, which
    is looked up a row per token, unless it is also the (tied) LM head."""
    return sizes["projections"] + sizes["other"] + (sizes["lm_head"] or sizes["embedding"])


def release(engine) -> None:
    """Free an engine's device memory before the next is built (an LLM or an EngineCore)."""
    engine.shutdown() if hasattr(engine, "shutdown") else engine.close()
    gc.collect()
    torch.cuda.empty_cache()


def decode_rows(core, floor, batches=(1, 16), context: int = 1024, steps: int = 12,
                profiled: tuple[int, ...] = ()) -> list[tuple]:
    """(batch, step seconds, floor seconds, bound) per batch: `batch` requests of
    context - 64 prompt tokens prefilled, then the median of 3 runs of `steps`
    overlapped decode steps, as decode_step.py times them; the batches in
    `profiled` also print where their steps' time goes."""
    from decode_step import profile, timed_steps
    from headrace.sampling_params import SamplingParams

    rows, sched = [], core.scheduler
    for batch in batches:
        rng = random.Random(0)
        sp = SamplingParams(temperature=0.6, max_tokens=128, ignore_eos=True)
        for i in range(batch):
            core.add_request(f"{batch}-{i}", [rng.randrange(3, 10000) for _ in range(context - 64)], sp, time.time())
        while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
            core.step()  # prefill
        core.step()
        core.step()  # decode: warm
        times = []
        cached = sum(r.num_expected for r in sched.running) + batch * (3 * steps // 2)
        for _ in range(3):
            times.append(timed_steps(core, steps))
        if batch in profiled:
            profile(core, steps)  # after the timed runs: the floor's context is theirs
        assert len(sched.running) == batch, "a request finished before the timed steps"
        t_bytes, t_flops = floor.seconds(1, cached, batch, batch, cached)
        rows.append((batch, statistics.median(times), t_bytes + t_flops, "memory" if t_bytes > t_flops else "compute"))
        while core.has_unfinished:
            core.step()
    return rows


def variants(formats: list[str], embeddings: bool) -> list[tuple[str, str, bool]]:
    """(label, format, quantize_embeddings) of each engine the memory and
    decode parts build: every format, then with embeddings every quantized
    format again with its embedding table (and LM head, unless int4-head's
    4-bit one) in FP8."""
    return [(f, f, False) for f in formats] + [(f"{f}+emb", f, True) for f in formats if embeddings and f != "bf16"]


def format_parts(args, formats, bw, rate) -> None:
    """The memory and decode parts: one engine per format (and variant)."""
    from benchmarks_common import StepFloor, qwen3_8b_checkpoint
    from headrace.config import EngineArgs
    from headrace.core.engine import EngineCore

    memory, decode = {}, {}
    for label, fmt, emb in variants(formats, args.quantize_embeddings):
        model = str(qwen3_8b_gptq(fmt == "int4-head") if fmt.startswith("int4") else qwen3_8b_checkpoint())
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        try:
            core = EngineCore(EngineArgs(model=model, quantization=QUANTIZATION[fmt], device="cuda", max_num_seqs=16,
                                         max_model_len=1152, enable_prefix_caching=False, num_kv_blocks=16 * 72,
                                         quantize_embeddings=emb))
        except Exception as e:  # one format's failure is reported; the others still run
            print(f"{label}: the engine failed to start: {type(e).__name__}: {e}")
            continue
        torch.cuda.synchronize()
        kv = core.executor.kv
        allocated = torch.cuda.memory_allocated() - before - kv.numel() * kv.element_size()
        sizes = held_bytes(core.executor.model)
        memory[label] = (core.quantization, sizes, allocated)
        if "decode" in args.parts:
            floor = StepFloor(core, bw, rate)
            floor.weight_bytes = step_read_bytes(sizes)  # as held, not the bf16 count
            profiled = tuple(map(int, args.profile.split(","))) if args.profile else ()
            if profiled:
                print(f"--- {label}: where the decode steps' time goes at batch {args.profile}")
            decode[label] = (floor.weight_bytes, decode_rows(core, floor, args.batches, profiled=profiled))
        release(core)
        del core

    if "memory" in args.parts and memory:
        print("\nweight memory on the GPU (targets, projections: fp8 <= 0.53x, int4 <= 0.3x of bf16)")
        print(f"{'format':<13} {'weights GiB':>11} {'x bf16':>7} {'proj GiB':>9} {'x bf16':>7} "
              f"{'vocab GiB':>9} {'alloc-KV GiB':>12}  quantization")
        base = memory["bf16"][1] if "bf16" in memory else None
        for fmt, (quant, sizes, allocated) in memory.items():
            total = sum(sizes.values())
            r_all = f"{total / sum(base.values()):7.3f}" if base else f"{'-':>7}"
            r_proj = f"{sizes['projections'] / base['projections']:7.3f}" if base else f"{'-':>7}"
            vocab = sizes["embedding"] + sizes["lm_head"]
            print(f"{fmt:<13} {total / GiB:11.2f} {r_all} {sizes['projections'] / GiB:9.2f} {r_proj} "
                  f"{vocab / GiB:9.2f} {allocated / GiB:12.2f}  {quant}")
    if decode:
        print("\ndecode step, context 1024, overlapped scheduling (target at batch 1: <= 1.5x floor)")
        print(f"{'format':<13} {'read GiB':>8} {'batch':>5} {'step ms':>8} {'floor ms':>8} {'x floor':>7}  bound")
        for fmt, (read, rows) in decode.items():
            for batch, t, fl, bound in rows:
                print(f"{fmt:<13} {read / GiB:8.2f} {batch:>5} {t * 1e3:8.3f} {fl * 1e3:8.3f} {t / fl:7.2f}  {bound}")


def community(args, formats, bw, rate) -> None:
    from benchmarks_common import ScheduleRecorder, StepFloor, StepTimeline, by_rows, qwen3_8b_checkpoint, workload
    from headrace.config import EngineArgs
    from headrace.core.engine import EngineCore
    from throughput import kernel_table, run_ours

    model = str(qwen3_8b_checkpoint())
    prompts, max_tokens = workload(args.num_requests)
    rows = {}
    for fmt in [f for f in formats if not f.startswith("int4")]:
        core = EngineCore(EngineArgs(model=model, quantization=QUANTIZATION[fmt], device="cuda", max_model_len=4096,
                                     max_num_seqs=256, enable_prefix_caching=False))
        floor = StepFloor(core, bw, rate)
        floor.weight_bytes = step_read_bytes(held_bytes(core.executor.model))
        run_ours(core, prompts, [2] * len(prompts))  # warm-up: every prefill shape
        timeline = StepTimeline(core) if args.by_rows else None
        rec = ScheduleRecorder(core)
        elapsed, out, _ = run_ours(core, prompts, max_tokens)
        rec.detach()
        t_floor = sum(floor.seconds(rec.steps, rec.kv_tokens, rec.tokens, rec.sampled_rows, rec.pairs))
        rows[fmt] = (out, elapsed, rec.steps, t_floor)
        if timeline:
            torch.cuda.synchronize()
            print(f"--- {fmt}: the community run's steps by rows")
            print("\n".join("  " + line for line in by_rows(rec.per_step, timeline.spans(), floor)))
        if args.kernels:
            print(f"--- {fmt}: ", end="")
            kernel_table(core, prompts, max_tokens)
        release(core)
        del core
    print(f"\ncommunity workload, {args.num_requests} requests (target: fp8 >= 1.3x bf16 tok/s)")
    print(f"{'format':<6} {'out tokens':>10} {'seconds':>8} {'steps':>6} {'tok/s':>7} {'x bf16':>7} {'x floor':>7}")
    for fmt, (out, elapsed, steps, t_floor) in rows.items():
        ratio = f"{out / elapsed / (rows['bf16'][0] / rows['bf16'][1]):7.2f}" if "bf16" in rows else f"{'-':>7}"
        print(f"{fmt:<6} {out:>10} {elapsed:8.2f} {steps:>6} {out / elapsed:7.0f} {ratio} {elapsed / t_floor:7.2f}")


def gguf() -> None:
    from gguf_parity import first_divergence
    from headrace import LLM, SamplingParams
    from headrace.checkpoint.smollm2 import smollm2_gguf
    from headrace.frontend.cli import DEMO_PROMPTS

    path = str(smollm2_gguf(progress=True))
    chats = [[{"role": "user", "content": t}] for t in DEMO_PROMPTS]

    def seconds(llm, max_tokens: int) -> float:
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            llm.generate(chats[:1], sp, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    runs = {}
    for label, extra in (("packed", {}), ("bf16", {"dequantize_gguf": True})):
        llm = LLM(path, device="cuda", dtype="bfloat16", max_model_len=1024, **extra)
        held = sum(held_bytes(llm.engine.executor.model).values())
        llm.generate(chats[:1], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)  # warm-up
        tok_s = 255 / (seconds(llm, 256) - seconds(llm, 1))
        greedy = llm.generate(chats, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
        runs[label] = (llm.engine.quantization, held, tok_s, [o.outputs[0].token_ids for o in greedy])
        release(llm)
        del llm
    print(f"\nSmolLM2-135M-Instruct Q4_1 GGUF ({path}): packed blocks vs dequantized to bf16 at load")
    print(f"{'weights':<8} {'held MiB':>8} {'x bf16':>7} {'decode tok/s':>12} {'x bf16':>7}  quantization")
    for label, (quant, held, tok_s, _) in runs.items():
        print(f"{label:<8} {held / 2**20:8.1f} {held / runs['bf16'][1]:7.3f} {tok_s:12.0f} "
              f"{tok_s / runs['bf16'][2]:7.2f}  {quant}")
    print("greedy 64 tokens, packed vs bf16: first differing token")
    for text, a, b in zip(DEMO_PROMPTS, runs["packed"][3], runs["bf16"][3]):
        d = first_divergence(a, b)
        print(f"  {text[:48]:<48} {'same' if d is None else d} ({len(a)} and {len(b)} tokens)")


def _batches(value: str) -> tuple[int, ...]:
    """--batches: positive batch sizes, comma-separated."""
    try:
        batches = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"batch sizes are integers, got {value!r}") from None
    if not batches or min(batches) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes are 1 or more, got {value!r}")
    return batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma list of {', '.join(FORMATS)}")
    parser.add_argument("--quantize-embeddings", action="store_true",
                        help="memory and decode also for the quantized formats with quantize_embeddings=True")
    parser.add_argument("--num-requests", type=int, default=64, help="requests of the community workload")
    parser.add_argument("--batches", type=_batches, default=(1, 16),
                        help="BATCH[,...]: the decode part's batch sizes")
    parser.add_argument("--profile", default="", help="BATCH[,...]: profile those batches' decode steps")
    parser.add_argument("--by-rows", action="store_true",
                        help="community: each format's steps by batch rows (GPU time, wait for the host, floor)")
    parser.add_argument("--kernels", action="store_true",
                        help="community: each format's GPU time by kernel over one more run under the profiler")
    args = parser.parse_args()
    args.parts, formats = args.parts.split(","), args.formats.split(",")
    for given, known in ((args.parts, PARTS), (formats, FORMATS)):
        if set(given) - set(known):
            parser.error(f"unknown {sorted(set(given) - set(known))}; choose among {', '.join(known)}")
    if (args.by_rows or args.kernels) and "community" not in args.parts:
        parser.error("--by-rows and --kernels split the community part's runs: they need --parts community")

    from benchmarks_common import measure_ceilings, source_id

    print(f"{torch.cuda.get_device_name()}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"source {source_id()}")
    if {"memory", "decode", "community"} & set(args.parts):
        bw, rate = measure_ceilings(torch.device("cuda"))
        print(f"measured: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s")
        if {"memory", "decode"} & set(args.parts):
            format_parts(args, formats, bw, rate)
        if "community" in args.parts:
            community(args, formats, bw, rate)
    if "gguf" in args.parts:
        gguf()


if __name__ == "__main__":
    main()
