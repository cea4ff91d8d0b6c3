"""The `headrace` command line."""
from __future__ import annotations

import argparse
import sys

DEMO_PROMPTS = [
    "The river at dawn",
    "def fibonacci(n):",
    "今天天气很好，",
    "Emoji story: 🌊",
]


def _generate(args: argparse.Namespace) -> int:
    from headrace import LLM, SamplingParams

    model = args.model
    if model is None:
        from headrace.testing import demo_checkpoint

        model = str(demo_checkpoint())
        print(f"model: the built-in demo checkpoint (random weights) at {model}", file=sys.stderr)
    llm = LLM(model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len, seed=args.seed)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens, seed=args.seed
    )
    for out in llm.generate(args.prompt or DEMO_PROMPTS, params):
        c = out.outputs[0]
        print(f"--- {out.prompt!r} ({len(c.token_ids)} tokens, {c.finish_reason})")
        print(out.prompt + c.text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="headrace", description="An LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts offline and print the completions")
    gen.add_argument("--model", help="checkpoint directory or cached hub id (default: the built-in demo)")
    gen.add_argument("--prompt", action="append", help="a prompt; repeat for several (default: a demo set)")
    gen.add_argument("--max-tokens", type=int, default=48)
    gen.add_argument("--temperature", type=float, default=0.8)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    gen.add_argument("--device", default="auto")
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.set_defaults(func=_generate)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"headrace: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
