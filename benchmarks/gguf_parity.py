"""The SmolLM2 GGUF file on a device in float32 and bfloat16 against
transformers' float32 on the same file: greedy tokens per chat prompt, and
where bfloat16 first departs from the reference.

    python3 benchmarks/gguf_parity.py [--device cuda] [--max-tokens 64] [--model FILE.gguf]
"""
from __future__ import annotations

import argparse
import os

import torch

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Give me three tips for a good night's sleep.",
    "¿Cuál es la capital de España? Responde en español.",
    "用中文回答：中国的首都是哪里？",
    "Explain what a hash table is in two sentences.",
    "List the planets of the solar system.",
    "What is 12 times 7?",
]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where a and b differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="a .gguf file (default: the SmolLM2 demo model)")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from headrace import LLM, SamplingParams
    from headrace.checkpoint.smollm2 import smollm2_gguf

    path = os.path.abspath(args.model or smollm2_gguf(progress=True))
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
               for q in QUESTIONS]
    ref_model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=torch.float32).to(args.device).eval()
    reference = []
    for p in prompts:
        with torch.no_grad():
            out = ref_model.generate(torch.tensor([p], device=args.device), max_new_tokens=args.max_tokens,
                                     do_sample=False)
        reference.append(out[0, len(p):].tolist())
    del ref_model

    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    results = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(path, device=args.device, dtype=dtype, max_model_len=1024)
        results[dtype] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        llm.shutdown()

    print(f"{path} on {args.device}, greedy {args.max_tokens} tokens; reference: transformers float32, same file")
    print("| prompt | reference tokens | float32 | bfloat16: first divergence |")
    print("| --- | ---: | --- | --- |")
    for q, ref, f32, bf16 in zip(QUESTIONS, reference, results["float32"], results["bfloat16"]):
        d32, d16 = first_divergence(f32, ref), first_divergence(bf16, ref)
        print(f"| {q[:40]} | {len(ref)} | {'identical' if d32 is None else f'differs at {d32}'} | "
              f"{'identical' if d16 is None else f'token {d16}'} |")
    same = sum(first_divergence(f, r) is None for f, r in zip(results["float32"], reference))
    print(f"float32 token-identical on {same} of {len(QUESTIONS)} prompts")


if __name__ == "__main__":
    main()
