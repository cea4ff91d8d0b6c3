"""Beam search: its throughput, its decode step against a greedy decode step
of as many rows, its floor, and transformers' beam search in the same run.

    python3 benchmarks/beam_search.py [--model-shape 8b|0.6b] [--num-prompts 100] [--prompt-len 256]
                                      [--output-len 256] [--beam-width 4] [--hf-prompts 8] [--smoke]

Workload: seed 0; --num-prompts prompts of --prompt-len random token ids in
[3, 10000); beam search of --beam-width beams, all returned
(SamplingParams(use_beam_search=True, best_of=n=width, temperature=0)),
--output-len tokens with ignore_eos; the Qwen3-8B shape (or 0.6B) with
random bf16 weights; max_model_len prompt + output; no prefix caching.

The comparison run decodes num_prompts * width independent greedy requests
of other prompts of the same length: the same rows, each with the same
context at each step. A decode step is a step in which every row computes
one token and all rows are there; its time is the median interval between
the ends of consecutive such steps (CUDA events after each queued step), so
it holds the GPU's work and any wait for the host.

The floor (benchmarks_common.StepFloor) comes from the schedule the engine
ran: every step reads all weights once and each row's cached KV at the
copy bandwidth measured in this run, plus matmul and attention FLOPs at the
measured bf16 matmul rate. Each beam's row counts its whole context, shared
prompt blocks included, as the attention kernel reads it; the floor with
those blocks read once per group is printed beside it.

The peer: transformers' generate(num_beams=width, num_return_sequences=width,
do_sample=False, early_stopping=False, length_penalty=1.0) on the first
--hf-prompts prompts as one batch, with no EOS (the model's generation
config loses its eos_token_id), after headrace is shut down.

--smoke runs a tiny random checkpoint on the CPU (4 prompts of 16 tokens,
8 output tokens), to check the script, not to measure.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

import torch

from benchmarks_common import ScheduleRecorder, StepFloor, measure_ceilings


class DecodeSteps:
    """Marks the end of every step the executor queues (a CUDA event, or the
    host clock on the CPU) and whether it was a full decode step: `rows`
    rows, each computing one token."""

    def __init__(self, core, rows: int, cuda: bool) -> None:
        self.marks: list = []  # step -> (full decode step, end mark)
        execute = core.executor.execute

        def marked(sched):
            pending = execute(sched)
            n = sched.num_scheduled_tokens
            full = len(n) == rows and all(v == 1 for v in n.values())
            if cuda:
                mark = torch.cuda.Event(enable_timing=True)
                mark.record()
            else:
                mark = time.perf_counter()
            self.marks.append((full, mark))
            return pending

        core.executor.execute = marked

    def median(self) -> tuple[float, int]:
        """(median seconds between the ends of consecutive full decode steps,
        full decode steps); call after the device is synchronised."""
        def gap(a, b):
            return a.elapsed_time(b) / 1e3 if isinstance(a, torch.cuda.Event) else b - a
        gaps = [gap(a, b) for (fa, a), (fb, b) in zip(self.marks, self.marks[1:]) if fa and fb]
        return (statistics.median(gaps) if gaps else float("nan")), sum(f for f, _ in self.marks)


def run(llm, prompts, sp, rows: int, cuda: bool) -> dict:
    """One timed llm.generate over prompts, recording its schedule and decode steps."""
    core = llm.engine
    execute = core.executor.execute
    rec = ScheduleRecorder(core)
    log = DecodeSteps(core, rows, cuda)
    steps_before = core.stats()["num_steps"]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    core.executor.execute = execute
    step, full = log.median()
    returned = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return dict(wall=wall, outs=outs, rec=rec, step=step, full_steps=full, returned=returned,
                engine_steps=core.stats()["num_steps"] - steps_before)


def run_peer(model_dir: str, prompts, width: int, output_len: int, device: str, dtype) -> float:
    """Seconds of transformers' beam search over prompts as one batch (after a short warm-up)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    # generate() fills a None eos_token_id from the model's generation config: clear it there.
    model.generation_config.eos_token_id = None
    ids = torch.tensor(prompts, device=device)

    def generate(batch, new_tokens):
        cfg = GenerationConfig(num_beams=width, num_return_sequences=width, do_sample=False, early_stopping=False,
                               length_penalty=1.0, max_new_tokens=new_tokens, eos_token_id=None,
                               pad_token_id=model.config.pad_token_id or 0)
        with torch.no_grad():
            return model.generate(batch, attention_mask=torch.ones_like(batch), generation_config=cfg)

    generate(ids[:1], 4)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = generate(ids, output_len)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    if tuple(out.shape) != (len(prompts) * width, ids.shape[1] + output_len):
        raise RuntimeError(f"transformers returned {tuple(out.shape)}, not {len(prompts) * width} sequences "
                           f"of {ids.shape[1] + output_len} tokens")
    return elapsed  # the model goes with this frame; the caller empties the CUDA cache


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-shape", choices=("8b", "0.6b"), default="8b")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--hf-prompts", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="a tiny checkpoint on the CPU: checks the script")
    args = parser.parse_args()

    from headrace import LLM, SamplingParams

    if args.smoke:
        from headrace import envs
        from headrace.testing import make_checkpoint

        model = str(make_checkpoint(envs.cache_dir() / "beam-search-smoke", "qwen3", num_heads=4, num_kv_heads=2,
                                    head_dim=32, tie_word_embeddings=True))
        args.num_prompts, args.prompt_len, args.output_len = 4, 16, 8
        device, dtype, cuda = "cpu", "float32", False
    else:
        from benchmarks_common import qwen3_06b_checkpoint, qwen3_8b_checkpoint

        model = str(qwen3_8b_checkpoint() if args.model_shape == "8b" else qwen3_06b_checkpoint())
        device, dtype, cuda = "cuda", "bfloat16", True
    width, num, out_len = args.beam_width, args.num_prompts, args.output_len
    rows = num * width
    result = dict(benchmark="beam_search", model_shape="tiny" if args.smoke else args.model_shape, num_prompts=num,
                  prompt_len=args.prompt_len, output_len=out_len, beam_width=width)
    if cuda:
        bw, rate = measure_ceilings(torch.device("cuda"))
        torch.cuda.empty_cache()
        result.update(device=torch.cuda.get_device_name(), copy_tb_s=bw / 1e12, matmul_tflop_s=rate / 1e12)
        print(f"{result['device']}: measured copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s")
    llm = LLM(model, device=device, dtype=dtype, max_model_len=args.prompt_len + out_len, max_num_seqs=rows,
              enable_prefix_caching=False)
    rng, vocab = random.Random(0), min(10000, llm.engine.model_config.vocab_size)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(num + rows)]
    beam_prompts, plain_prompts = prompts[:num], prompts[num:]
    b = None
    try:
        def beam(max_tokens):
            return SamplingParams(use_beam_search=True, best_of=width, n=width, temperature=0.0,
                                  max_tokens=max_tokens, ignore_eos=True)

        llm.generate(beam_prompts, beam(4), use_tqdm=False)  # warm-up
        b = run(llm, beam_prompts, beam(out_len), rows, cuda)
    except (TypeError, ValueError, NotImplementedError, RuntimeError) as e:
        if not args.smoke:
            raise
        print(f"beam search not run: {type(e).__name__}: {e}")
    if b is not None:
        complete = all(len(o.outputs) == width and all(len(c.token_ids) == out_len for c in o.outputs)
                       for o in b["outs"])
        best = [o.outputs[0].cumulative_logprob for o in b["outs"] if o.outputs[0].cumulative_logprob is not None]
        print(f"headrace beam search: {num} prompts x {width} beams x {out_len} tokens in {b['wall']:.2f} s = "
              f"{num / b['wall']:.2f} req/s, {rows * out_len / b['wall']:.0f} beam tok/s, "
              f"{b['returned'] / b['wall']:.0f} returned tok/s ({b['returned']} tokens"
              f"{'' if complete else '; NOT every request returned width sequences of output_len tokens'})"
              + (f"; best beams' cumulative logprob, median {statistics.median(best):.2f}" if best else ""))
        result.update(beam_wall_s=b["wall"], beam_req_s=num / b["wall"], beam_tok_s=rows * out_len / b["wall"],
                      returned_tok_s=b["returned"] / b["wall"], beam_complete=complete)

    llm.generate(plain_prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)  # warm-up
    p = run(llm, plain_prompts, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True, n=1), rows, cuda)
    print(f"headrace greedy: {rows} requests x {out_len} tokens in {p['wall']:.2f} s = "
          f"{rows * out_len / p['wall']:.0f} tok/s")
    result.update(greedy_wall_s=p["wall"], greedy_tok_s=rows * out_len / p["wall"])
    print(f"{'run':>7} {'steps':>6} {'decode':>6} {'wall/out ms':>11} {'step ms':>8}  "
          f"(decode: full steps of {rows} rows)")
    for name, r in (("beam", b), ("greedy", p)):
        if r is not None:
            print(f"{name:>7} {r['rec'].steps:>6} {r['full_steps']:>6} {r['wall'] / out_len * 1e3:>11.2f} "
                  f"{r['step'] * 1e3:>8.3f}")
            result.update({f"{name}_steps": r["rec"].steps, f"{name}_engine_steps": r["engine_steps"],
                           f"{name}_decode_steps": r["full_steps"], f"{name}_step_ms": r["step"] * 1e3})
    if b is not None:
        ratio = b["step"] / p["step"]
        result.update(step_ratio=ratio)
        print(f"beam step / greedy step = {ratio:.3f} (target <= 1.10); "
              f"whole runs {b['wall'] / p['wall']:.3f}")

    if cuda and b is not None:
        step_floor = StepFloor(llm.engine, bw, rate)
        rec = b["rec"]
        t_bytes, t_flops = step_floor.seconds(rec.steps, rec.kv_tokens, rec.tokens, rec.sampled_rows, rec.pairs)
        floor = t_bytes + t_flops
        # Beams 1.. read the prompt's full blocks, which beam 0 holds too, at each decode step.
        block = llm.engine.cache_config.block_size
        shared = (width - 1) * num * (args.prompt_len // block * block) * (out_len - 1)
        floor_shared = floor - shared * step_floor.kv_per_token / bw
        print(f"beam floor: {rec.steps} steps x {step_floor.weight_bytes / 1e9:.1f} GB of weights + "
              f"{rec.kv_tokens * step_floor.kv_per_token / 1e9:.0f} GB of KV = {t_bytes:.2f} s, FLOPs {t_flops:.2f} s; "
              f"floor {floor:.2f} s, time / floor = {b['wall'] / floor:.2f} "
              f"({'memory' if t_bytes > t_flops else 'compute'} bound); with shared prompt blocks read once per "
              f"group {floor_shared:.2f} s, time / floor = {b['wall'] / floor_shared:.2f}")
        result.update(floor_bytes_s=t_bytes, floor_flops_s=t_flops, floor_s=floor, x_floor=b["wall"] / floor,
                      floor_shared_s=floor_shared, x_floor_shared=b["wall"] / floor_shared)
    llm.shutdown()
    del llm
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

    sub = beam_prompts[: args.hf_prompts]
    try:
        if not sub:
            raise ValueError("--hf-prompts 0: not run")
        peer = run_peer(model, sub, width, out_len, device, torch.bfloat16 if cuda else torch.float32)
    except Exception as e:  # the peer's own failure is reported, not hidden
        print(f"transformers beam search failed: {type(e).__name__}: {e}")
    else:
        print(f"transformers beam search: {len(sub)} prompts in one batch in {peer:.2f} s = {len(sub) / peer:.3f} req/s"
              + (f"; headrace {num / b['wall'] / (len(sub) / peer):.1f}x" if b is not None else ""))
        result.update(hf_prompts=len(sub), hf_wall_s=peer, hf_req_s=len(sub) / peer)
    finally:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
