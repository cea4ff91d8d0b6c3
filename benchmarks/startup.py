"""Start-up to ready, and where its seconds go: LLM, AsyncEngine.from_model and headrace serve.

    python3 benchmarks/startup.py [--model PATH] [--device cuda] [--paths llm,async,serve]
                                  [--repeats 2] [--warmup 1] [--tree NAME=DIR ...] [--api-servers 2]

Every run is a fresh process (sys.executable) in a private temporary directory:
  llm    a script that imports torch, then headrace's LLM, builds LLM(model) and
         generates 8 tokens for one prompt: spawn to LLM() returned ("ready"),
         and to the first output;
  async  a script that builds AsyncEngine.from_model(model) and awaits start()
         (the core loaded and handshaken), then streams 8 tokens of one request;
  serve  `headrace serve --model M --api-servers N --port 0`: spawn to the first
         GET /health 200 from one of its API servers.
The llm and async scripts print the seconds of their imports. The engine core's
log line "engine ready in S s (phase s, ...)" (stderr, INFO) gives its phases
where the tree measured writes it.

--tree NAME=DIR measures the headrace at DIR/headrace (DIR first on PYTHONPATH)
instead of the one found; with several, every repeat runs each tree in turn,
so they share the machine's state. Figures: median (min-max) of --repeats runs
after --warmup untimed ones per tree and path (the first start of a tree
compiles its Triton kernels; the warm-up's seconds are printed too).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
from pathlib import Path

from serve_startup import API_SERVER, HEADRACE, Child, cmdline, live

TOKENS = 8
LLM_SCRIPT = """
import json, logging, sys, time
t0 = time.perf_counter()
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
import torch
t_torch = time.perf_counter()
from headrace import LLM, SamplingParams
import headrace.frontend.llm
t_headrace = time.perf_counter()
llm = LLM(sys.argv[1], device=sys.argv[2])
print("READY", flush=True)
t_ready = time.perf_counter()
out = llm.generate(["The river"], SamplingParams(max_tokens=int(sys.argv[3]), ignore_eos=True), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == int(sys.argv[3])
print("FIRST", json.dumps({"import torch": t_torch - t0, "import headrace": t_headrace - t_torch,
                           "generate": time.perf_counter() - t_ready}), flush=True)
llm.shutdown()
"""
ASYNC_SCRIPT = """
import asyncio, json, logging, sys, time
t0 = time.perf_counter()
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
from headrace import AsyncEngine, SamplingParams
import headrace.frontend.async_engine
t_import = time.perf_counter()

async def main():
    engine = AsyncEngine.from_model(sys.argv[1], device=sys.argv[2])
    t_spawned = time.perf_counter()
    await engine.start()
    print("READY", flush=True)
    t_ready = time.perf_counter()
    n = 0
    async for out in engine.generate("The river", SamplingParams(max_tokens=int(sys.argv[3]), ignore_eos=True)):
        n = len(out.outputs[0].token_ids)
    assert n == int(sys.argv[3]), n
    print("FIRST", json.dumps({"import headrace": t_import - t0, "from_model": t_spawned - t_import,
                               "start()": t_ready - t_spawned, "generate": time.perf_counter() - t_ready}),
          flush=True)
    await engine.aclose()

asyncio.run(main())
"""
PHASES = re.compile(r"engine ready in ([0-9.]+) s \((.*)\)")


def core_phases(log: Path) -> dict[str, float]:
    """The phases of the last "engine ready" line in log, or {} without one."""
    found = PHASES.findall(log.read_text(errors="replace")) if log.exists() else []
    if not found:
        return {}
    total, parts = found[-1]
    phases = {"core total": float(total)}
    for part in parts.split(", "):
        name, _, seconds = part.rpartition(" ")[0].rpartition(" ")
        phases[name] = float(seconds)
    return phases


def run_script(script: str, args, tmp: Path, children: list, name: str) -> dict[str, float]:
    log = f"{name}.log"
    (tmp / log).unlink(missing_ok=True)
    child = Child([sys.executable, "-c", script, args.model, args.device, str(TOKENS)], tmp, log, children)
    try:
        ready = child.line(r"^READY", args.timeout)[0]
        first, line = child.line(r"^FIRST ", args.timeout)
        child.proc.wait(timeout=args.timeout)
    finally:
        if child in children:
            child.stop(children)
    return {"ready": ready, "first output": first} | json.loads(line.split(" ", 1)[1]) | core_phases(tmp / log)


def run_serve(args, tmp: Path, children: list, name: str) -> dict[str, float]:
    log = f"{name}.log"
    (tmp / log).unlink(missing_ok=True)

    def first_port(parent: int) -> int | None:
        apis = [pid for pid in live(lambda ppid, pgrp: ppid == parent) if API_SERVER in cmdline(pid)]
        found = [re.search(r"--port (\d+)", cmdline(pid)) for pid in apis]
        return int(found[0].group(1)) if found and found[0] else None

    parent = Child([*HEADRACE, "serve", "--model", args.model, "--api-servers", str(args.api_servers),
                    "--port", "0", "--device", args.device], tmp, log, children)
    try:
        ready = parent.health(lambda: first_port(parent.pid), args.timeout)
        everyone = parent.line(r" at http://\S+:\d+/v1", args.timeout)[0]
    finally:
        parent.stop(children)
    return {"ready": ready, f"all {args.api_servers} API servers": everyone} | core_phases(tmp / log)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint (default: the Qwen3-0.6B shape, random bf16)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--paths", default="llm,async,serve")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--api-servers", type=int, default=2)
    parser.add_argument("--tree", action="append", default=[], help="NAME=DIR: measure DIR/headrace (repeatable)")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    if args.model is None:
        from benchmarks_common import qwen3_06b_checkpoint
        args.model = str(qwen3_06b_checkpoint())
    bad = [t for t in args.tree if "=" not in t]
    if bad:
        parser.error(f"--tree takes NAME=DIR, got {bad}")
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": ""}
    paths = args.paths.split(",")
    runners = {"llm": lambda *a: run_script(LLM_SCRIPT, *a), "async": lambda *a: run_script(ASYNC_SCRIPT, *a),
               "serve": run_serve}
    unknown = [p for p in paths if p not in runners]
    if unknown:
        parser.error(f"unknown paths {unknown}; known: {', '.join(runners)}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs the finally below
    tmp, children = Path(tempfile.mkdtemp(prefix="startup-")), []
    base_path = os.environ.get("PYTHONPATH", "")
    results: dict[tuple[str, str], list[dict]] = {}
    try:
        print(f"model {args.model} on {args.device}; logs in {tmp}", flush=True)
        for i in range(args.warmup + args.repeats):
            for tree, directory in trees.items():
                os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (directory, base_path) if p)
                for path in paths:
                    got = runners[path](args, tmp, children, f"{tree}-{path}")
                    kind = "warm-up" if i < args.warmup else "run"
                    print(f"{tree} {path} {kind} {i}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)
                    if i >= args.warmup:
                        results.setdefault((tree, path), []).append(got)
        print("\n| tree | path | seconds: median (min-max) of each figure |\n| --- | --- | --- |")
        for (tree, path), runs in results.items():
            keys = [k for k in runs[0] if all(k in r for r in runs)]
            cells = [f"{k} {statistics.median(r[k] for r in runs):.2f} "
                     f"({min(r[k] for r in runs):.2f}-{max(r[k] for r in runs):.2f})" for k in keys]
            print(f"| {tree} | {path} | {'; '.join(cells)} |")
        shutil.rmtree(tmp, ignore_errors=True)  # kept, with the logs, when something failed
    finally:
        os.environ["PYTHONPATH"] = base_path
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for child in reversed(children[:]):
            child.stop(children)


if __name__ == "__main__":
    main()
