"""What a user of the streaming frontend gets on the community workload:
AsyncEngine's output tokens/s against the engine core driven in-process, with
and without logprobs, from one and from several frontend processes, and the
latency of requests that arrive as a Poisson process; and the same burst
through the OpenAI-compatible HTTP server with the openai client.

    python3 benchmarks/serving.py [--parts inproc,burst,burst-logprobs,scaleout,http,poisson,http-poisson]
        [--num-requests 256] [--frontends 2] [--api-servers 2] [--http-clients 8] [--client openai|httpx]
        [--prompts text|ids] [--rates 8,24]
        [--tensor-parallel-size 1] [--data-parallel-size 1 (http: serve's cores)]
        [--repeats 1] [--poisson-runs 1] [--loop-load MS] [--py-spy SECONDS]
        [--device auto] [--model DIR] [--max-prompt 1024] [--max-output 1024] [--json PATH]

Workload (benchmarks_common.workload, as in throughput.py): seed 0; prompts
of uniform [100, 1024] random token ids in [0, 10000); max_tokens uniform
[100, 1024]; temperature 0.6; ignore_eos; max_model_len 4096; no prefix
caching; max_num_seqs = the number of requests. The model is the Qwen3-0.6B
shape with random bf16 weights and a tokenizer that covers its vocabulary
(on a CPU: the demo checkpoint, with max_model_len cut to its positions).
For smoke runs --max-prompt and --max-output cut prompts and max_tokens, and
ids are taken modulo a vocabulary smaller than 10000. Every part but inproc
sends each prompt as the text its ids decode to (--prompts text, the
default), as a user's application would, and the frontends tokenize it (the
token count changes a little; it is printed); --prompts ids sends the ids.
Token-id prompts cost the openai client time of its own, inside each
request's TTFT: it walks a list prompt element by element before sending
(about 5 ms for the workload's mean prompt, benchmarks/RESULTS.md).

Parts:
- inproc, the peer: EngineCore in this process; all requests added at once,
  step() until done; no sockets, no detokenization. On CUDA also the floor
  of the executed schedule, as throughput.py computes it.
- burst: AsyncEngine.from_model; all requests at once, one generate()
  stream each (DELTA), each counting the tokens of its outputs.
- burst-logprobs: the same with logprobs=5, each stream reading every
  position's logprob dict (they are built lazily); --repeats runs, counting
  the runs in which a stream got EngineDeadError.
- scaleout: the burst split over --frontends processes, each joined with
  AsyncEngine.connect to one `headrace core` process; without and with
  logprobs; timed from telling the ready processes to start until the last
  reports.
- http: the burst through `headrace serve` (--api-servers API server
  processes on one port, over a core with the engine args of burst), sent by
  --http-clients processes, each its share of the requests at once with the
  openai client's AsyncOpenAI: one streamed /v1/completions each (the
  prompt as --prompts says, ignore_eos and return_token_ids as extra body
  fields, usage in the last chunk); with --client httpx, a bare httpx client
  that parses each chunk's line with json instead, which sets what the openai
  client costs apart from the server. A request counts its chunks' token ids;
  one that errs, or gets other than its max_tokens there or in its usage,
  counts as failed. The client parses every chunk with pydantic, so one client
  process would bound the figure; the processes are timed as scaleout's.
  Target: at least 0.9 of burst's tok/s.
- poisson: for each of --rates, the requests arrive at exponential
  intervals (random.Random(1); the first at once), each submitted at its arrival time by its own
  task through one AsyncEngine (DELTA). At the client: TTFT = the first output
  carrying a token - submission; inter-token latency (ITL) = for each later
  output, (its arrival - the previous one's) / its number of tokens, counted
  once per token. Targets: TTFT p99 under 200 ms at 24 req/s; ITL p99 under
  3x its p50.
- http-poisson: the same arrivals through the server of http, spread over
  the --http-clients processes (client i sends arrivals i, i + n, ...,
  each at its time from the common "go"): one streamed /v1/completions each
  with return_token_ids, so that a chunk's tokens are counted exactly; TTFT
  and ITL as poisson measures them. Target: TTFT p99 and ITL p99 within 1.5x
  of poisson's at the same rate.
  --poisson-runs N runs each rate N times in both parts; run i through HTTP is
  set against AsyncEngine's run i, and a row a path and rate gives the median
  over the runs of each figure (the p99 of 256 requests is their third
  slowest, and one run's can move 2x from run to run).

Both Poisson parts also split the mean TTFT: the client's, against the
frontends' own (from a request's arrival at its frontend, after tokenizing,
to the core sampling its first token; of that, queued before its first step,
then prefilling), read from AsyncEngine's stats or the server's /metrics
before and after the run. What the client's mean has beyond the frontends'
is the way in before arrival and the way out after the core (for HTTP: the
request's sending and parsing, the output's detokenizing, SSE and parsing).
They also give the frontends' own TTFT p99 as the bound of its histogram
bucket (metrics.names' latency buckets: 20, 30, 40, 50, 75 ms ...): a client
p99 far above it was slow on the way in or out, not in the frontend or core.
And how busy the busiest client process was: its CPU seconds (all threads)
over the run's wall seconds; for poisson that is this process, frontend
included, for http-poisson the busiest of the client processes. A client
process near 1 queues its own requests' chunks, and its TTFT tail is its own.
Hence 8 client processes by default: at 24 req/s on an H200, 4 openai client
processes were 0.67-0.75 busy and their TTFT p99 1.4-2.0x AsyncEngine's with
the frontends' own p99 in the same bucket; 8 were 0.45-0.48 busy and 1.00-1.29x
(benchmarks/RESULTS.md).

burst, burst-logprobs and poisson share one spawned engine (a new one after
an EngineDeadError), run before scaleout starts its core, and the server of
http starts after that. Before each timed run the engine serves the same
requests cut to 2 output tokens (which compiles the kernels for every
prefill shape; for http, sent through HTTP by the client processes);
start-up and this warm-up are never timed. Throughput is output tokens over
the wall time from submitting the first request until the last finished.
--loop-load MS blocks each frontend process's event loop for MS ms every 10
ms with a busy Python loop during the burst, scaleout and poisson runs, as a
busy application would (not in the API servers of http).
--py-spy SECONDS samples every process (the benchmark, its cores, API
servers and clients) for the first SECONDS of each poisson and http-poisson
run (from the clients' "go") with py-spy, which must be on PATH, and prints per kind of process how
busy its Python threads were and where (benchmarks_common.host_profile).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import itertools
import json
import math
import random
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

import numpy as np

from benchmarks_common import (ScheduleRecorder, StepFloor, core_process, host_profile, measure_ceilings,
                               qwen3_06b_checkpoint, run_workers, worker_answer, workload)
from headrace import AsyncEngine, EngineDeadError, RequestOutputKind, SamplingParams
from headrace.frontend.async_engine import run
from headrace.metrics.names import PREFILL_TIME, QUEUE_TIME, TIME_TO_FIRST_TOKEN

PARTS = ("inproc", "burst", "burst-logprobs", "scaleout", "http", "poisson", "http-poisson")
HTTP_PARTS = ("http", "http-poisson")
NUM_LOGPROBS = 5


def params(max_tokens: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs,
                          output_kind=RequestOutputKind.DELTA)


def requests(args, vocab: int) -> tuple[list[list[int]], list[int]]:
    prompts, max_tokens = workload(args.num_requests)
    if vocab < 10000:
        prompts = [[t % vocab for t in p] for p in prompts]
    return [p[:args.max_prompt] for p in prompts], [min(m, args.max_output) for m in max_tokens]


def engine_options(args) -> dict:
    """The EngineArgs, beside the model, of the engines of inproc, burst and http."""
    return {"device": args.device, "max_model_len": args.max_model_len, "max_num_seqs": args.num_requests,
            "enable_prefix_caching": False, "tensor_parallel_size": args.tensor_parallel_size}


# ---- inproc: the engine core in this process ----

def step_all(core, prompts, max_tokens) -> tuple[float, int]:
    """Add every request, step until all finish: (seconds, output tokens)."""
    t0 = time.perf_counter()
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        core.add_request(f"{time.monotonic_ns()}-{i}", p, params(m), time.time())
    tokens = 0
    while core.has_unfinished:
        tokens += sum(len(o.new_token_ids) // 4 for o in core.step())
    return time.perf_counter() - t0, tokens


def in_process(args, prompts, max_tokens) -> dict:
    import torch

    from headrace.config import EngineArgs
    from headrace.core.engine import EngineCore

    cuda = args.device.startswith("cuda")
    ceilings = measure_ceilings(torch.device(args.device)) if cuda else None
    core = EngineCore(EngineArgs(model=args.model, **engine_options(args)))
    try:
        step_all(core, prompts, [2] * len(prompts))  # warm-up
        rec = ScheduleRecorder(core)
        seconds, tokens = step_all(core, prompts, max_tokens)
        rec.detach()
        result = {"tokens": tokens, "seconds": seconds, "steps": rec.steps}
        if cuda:
            bw, rate = ceilings
            floor = sum(StepFloor(core, bw, rate).seconds(rec.steps, rec.kv_tokens, rec.tokens, rec.sampled_rows,
                                                          rec.pairs))
            result.update(floor_seconds=floor, copy_bytes_per_s=bw, matmul_flops_per_s=rate)
        return result
    finally:
        core.close()


# ---- the frontend: bursts, Poisson arrivals, load on the event loop ----

@contextlib.asynccontextmanager
async def loop_load(ms: float):
    """While inside: every 10 ms, block the event loop for ms milliseconds."""
    async def block():
        while True:
            end = time.perf_counter() + ms / 1e3
            while time.perf_counter() < end:
                pass
            await asyncio.sleep(0.010)

    task = asyncio.create_task(block()) if ms > 0 else None
    try:
        yield
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def burst(engine, prompts, max_tokens, logprobs: int | None) -> dict:
    """All requests at once, one stream each: output tokens, logprob entries
    read, streams that got EngineDeadError, seconds."""
    async def stream(prompt, m):
        tokens = entries = 0
        try:
            async for out in engine.generate(prompt, params(m, logprobs)):
                sample = out.outputs[0]
                tokens += len(sample.token_ids)
                if logprobs is not None:
                    entries += sum(len(d) for d in sample.logprobs)
        except EngineDeadError:
            return tokens, entries, 1
        return tokens, entries, 0

    t0 = time.perf_counter()
    counts = await asyncio.gather(*map(stream, prompts, max_tokens))
    tokens, entries, dead = (sum(c) for c in zip(*counts))
    return {"tokens": tokens, "logprob_entries": entries, "dead_streams": dead, "seconds": time.perf_counter() - t0}


async def warm_up(engine, prompts, logprobs: int | None) -> None:
    await burst(engine, prompts, [2] * len(prompts), logprobs)


async def timed_burst(engine, prompts, max_tokens, logprobs: int | None, load_ms: float) -> dict:
    await warm_up(engine, prompts, logprobs)
    async with loop_load(load_ms):
        return await burst(engine, prompts, max_tokens, logprobs)


def percentiles(seconds: list[float]) -> list[float] | None:
    """p50, p90, p99 in milliseconds."""
    return [float(v) * 1e3 for v in np.percentile(seconds, [50, 90, 99])] if seconds else None


def arrival_times(n: int, rate: float) -> list[float]:
    """Seconds from the start at which n Poisson arrivals at rate come (the first at once)."""
    rng = random.Random(1)
    return list(itertools.accumulate((rng.expovariate(rate) for _ in range(n - 1)), initial=0.0))


class Latencies:
    """TTFT and ITL samples of streamed requests (seconds)."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []

    def chunk(self, submitted: float, last: float | None, now: float, k: int) -> float | None:
        """Record a chunk of k tokens arriving at now; returns the new last arrival."""
        if k == 0:
            return last
        if last is None:
            self.ttft.append(now - submitted)
        else:
            self.itl.extend([(now - last) / k] * k)
        return now


# FrontendStats' histograms of a request's way to its first token: from arrival at the frontend to the core
# sampling it; of that, queued before its first step; then prefilling.
SPANS = {"ttft": TIME_TO_FIRST_TOKEN, "queue": QUEUE_TIME, "prefill": PREFILL_TIME}
TTFT_BOUNDS = TIME_TO_FIRST_TOKEN.buckets + (float("inf"),)  # the TTFT histogram's buckets' upper bounds (s)


def stats_totals(stats) -> dict:
    """{span: (seconds summed, requests)} of one frontend's FrontendStats, and "ttft_le": its TTFT histogram's
    cumulative counts, one per bound of TTFT_BOUNDS."""
    snap = stats.snapshot()
    return {**{k: (getattr(snap, k).sum, getattr(snap, k).count) for k in SPANS},
            "ttft_le": tuple(n for _, n in snap.ttft.cumulative())}


def page_totals(metrics_url: str) -> dict:
    """{span: (seconds summed, requests)} over every frontend on a /metrics page (headrace serve's
    merges its API servers')."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as page:
        text = page.read().decode()
    span_of = {m.name: k for k, m in SPANS.items()}
    totals = {k: [0.0, 0] for k in SPANS}
    le = [0] * len(TTFT_BOUNDS)
    for family in text_string_to_metric_families(text):
        k = span_of.get(family.name)
        if k is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                totals[k][0] += sample.value
            elif sample.name.endswith("_count"):
                totals[k][1] += int(sample.value)
            elif sample.name.endswith("_bucket") and k == "ttft":
                le[TTFT_BOUNDS.index(float(sample.labels["le"]))] += int(sample.value)
    return {**{k: tuple(v) for k, v in totals.items()}, "ttft_le": tuple(le)}


def span_means(before: dict, after: dict) -> dict:
    """{span: mean ms} of the requests counted between two totals (None where none were)."""
    return {k: (1e3 * (after[k][0] - before[k][0]) / (after[k][1] - before[k][1])
                if after[k][1] > before[k][1] else None) for k in SPANS}


def frontend_spans(before: dict, after: dict) -> dict:
    """span_means, and "ttft_p99": the frontends' own TTFT p99 of the same requests, as the upper bound (ms) of
    the histogram bucket holding the ceil(0.99 n)-th fastest of n (None where none were, inf past the last
    bound). Set against the client's p99, it says whether a slow request was slow inside the frontend and core
    or on the way in and out (for HTTP: sending, parsing, detokenizing, SSE)."""
    counts = [a - b for a, b in zip(after["ttft_le"], before["ttft_le"])]
    rank = math.ceil(0.99 * counts[-1]) if counts and counts[-1] else None
    p99 = None if rank is None else next(1e3 * b for b, n in zip(TTFT_BOUNDS, counts) if n >= rank)
    return {**span_means(before, after), "ttft_p99": p99}


def mean_ms(seconds: list[float]) -> float | None:
    return 1e3 * statistics.fmean(seconds) if seconds else None


async def poisson(engine, prompts, max_tokens, rate: float, load_ms: float) -> dict:
    await warm_up(engine, prompts, None)
    arrivals = arrival_times(len(prompts), rate)
    lat = Latencies()

    async def request(prompt, m, at):
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        submitted, last, tokens = time.perf_counter(), None, 0
        try:
            async for out in engine.generate(prompt, params(m)):
                k = len(out.outputs[0].token_ids)
                last, tokens = lat.chunk(submitted, last, time.perf_counter(), k), tokens + k
        except EngineDeadError:
            return tokens, 1
        return tokens, 0

    async with loop_load(load_ms):
        before = stats_totals(engine.frontend_stats)
        start, cpu = time.perf_counter(), time.process_time()
        counts = await asyncio.gather(*map(request, prompts, max_tokens, arrivals))
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens, dead = (sum(c) for c in zip(*counts))
    return {"path": "AsyncEngine", "rate": rate, "requests": len(prompts) - dead, "tokens": tokens,
            "seconds": seconds, "dead_streams": dead, "ttft_ms": percentiles(lat.ttft), "itl_ms": percentiles(lat.itl),
            "ttft_mean_ms": mean_ms(lat.ttft), "client_busy": cpu / seconds,
            "frontend_ms": frontend_spans(before, stats_totals(engine.frontend_stats))}


class SpawnedEngine:
    """The AsyncEngine.from_model of the burst and poisson parts: spawned on
    first use, and again after a run in which it died."""

    def __init__(self, args) -> None:
        self.args = args
        self.stack: contextlib.AsyncExitStack | None = None
        self.engine: AsyncEngine | None = None

    async def measure(self, part, *part_args) -> dict:
        if self.engine is None:
            a = self.args
            self.stack = contextlib.AsyncExitStack()
            from prometheus_client import CollectorRegistry  # for the frontend's stats (poisson's spans)

            self.engine = await self.stack.enter_async_context(AsyncEngine.from_model(
                a.model, metrics_registry=CollectorRegistry(), **engine_options(a)))
        result = await part(self.engine, *part_args)
        if result["dead_streams"]:
            await self.close()
        return result

    async def close(self) -> None:
        if self.stack is not None:
            await self.stack.aclose()
        self.stack = self.engine = None


async def spawned_engine_parts(args, prompts, max_tokens) -> dict:
    """burst, burst-logprobs (--repeats runs) and poisson (each rate), in this
    order, through one SpawnedEngine: {part: [result of each run]}."""
    plan = {"burst": [("burst", timed_burst, None)],
            "burst-logprobs": [(f"burst-logprobs run {i + 1}", timed_burst, NUM_LOGPROBS) for i in range(args.repeats)],
            "poisson": [(f"poisson {rate:g} req/s{run_name(i, args)}", poisson, rate)
                        for rate in args.rates for i in range(args.poisson_runs)]}
    results = {}
    engine = SpawnedEngine(args)
    try:
        for part in (p for p in plan if p in args.parts):
            results[part] = []
            for name, measure, arg in plan[part]:
                with host_profile(args.py_spy if part == "poisson" else 0, name):
                    results[part].append(await engine.measure(measure, prompts, max_tokens, arg, args.loop_load))
                if part == "poisson":
                    number_runs(results[part])
                log(name, results[part][-1])
    finally:
        await engine.close()
    return results


# ---- scaleout: frontend processes joined to one core process ----

async def frontend_process(address: str, job: dict) -> dict:
    """A scale-out frontend (benchmarks_common.run_workers): warm up, ready, go, burst."""
    async with AsyncEngine.connect(address) as engine:
        await warm_up(engine, job["prompts"], job["logprobs"])
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        async with loop_load(job["loop_load_ms"]):
            return await burst(engine, job["prompts"], job["max_tokens"], job["logprobs"])


def scale_out(args, prompts, max_tokens) -> list[dict]:
    n = args.frontends
    flags = ["--max-model-len", str(args.max_model_len), "--no-enable-prefix-caching",
             "--max-num-seqs", str(len(prompts))]
    results = []
    with core_process(args.model, args.device, *flags) as address:
        for logprobs in (None, NUM_LOGPROBS):
            jobs = [{"prompts": prompts[i::n], "max_tokens": max_tokens[i::n], "logprobs": logprobs,
                     "loop_load_ms": args.loop_load} for i in range(n)]
            seconds, answers = run_workers([sys.executable, __file__, "--frontend", address], jobs)
            results.append({"logprobs": logprobs, "seconds": seconds, "frontends": answers,
                            **{k: sum(a[k] for a in answers) for k in ("tokens", "logprob_entries", "dead_streams")}})
            log(f"scaleout, logprobs={logprobs}", results[-1])
    return results


# ---- http: `headrace serve` and client processes (openai or httpx) ----

@contextlib.contextmanager
def api_server(args):
    """`headrace serve` on a free loopback port with the engine args of burst;
    yields its base URL once it serves, and stops it on leaving (SIGTERM,
    then SIGKILL; its core and API servers die with it)."""
    from headrace.config import EngineArgs
    from headrace.frontend.core_process import engine_args_to_cli

    cmd = [sys.executable, "-m", "headrace.frontend.cli", "serve", "--port", "0", "--api-servers",
           str(args.api_servers), "--data-parallel-size", str(args.data_parallel_size),
           *engine_args_to_cli(EngineArgs(model=args.model, **engine_options(args)))]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        ready = re.search(r" at (http://\S+/v1) ", proc.stdout.readline())
        if ready is None:
            raise RuntimeError("headrace serve did not start; its log is above")
        yield ready.group(1)
    finally:
        proc.terminate()
        try:
            proc.wait(40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def openai_chunks(client, model: str):
    """stream(prompt, max_tokens): the openai client's streamed completion, as (token ids, usage tokens or None)
    per chunk."""
    async def stream(prompt, m):
        chunks = await client.completions.create(
            model=model, prompt=prompt, max_tokens=m, temperature=0.6, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in chunks:
            k = len(chunk.choices[0].model_extra["token_ids"]) if chunk.choices else 0
            yield k, (chunk.usage.completion_tokens if chunk.usage else None)
    return stream


def httpx_chunks(client, url: str, model: str):
    """As openai_chunks, through a bare httpx client: each SSE data line parsed with json, nothing more."""
    async def stream(prompt, m):
        body = {"model": model, "prompt": prompt, "max_tokens": m, "temperature": 0.6, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True, "return_token_ids": True}
        async with client.stream("POST", url + "/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    k = len(chunk["choices"][0]["token_ids"]) if chunk["choices"] else 0
                    yield k, (chunk["usage"]["completion_tokens"] if chunk.get("usage") else None)
    return stream


async def http_requests(stream, prompts, max_tokens, arrivals=None) -> dict:
    """One streamed completion each (stream: openai_chunks or httpx_chunks), sent at its arrival time (seconds
    from now; None: all at once): output tokens (each chunk's token_ids, checked against the usage chunk's
    completion_tokens), failed requests, their first errors, seconds, TTFT and ITL samples."""
    lat = Latencies()

    async def complete(prompt, m, at):
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        submitted, last, tokens, usage = time.perf_counter(), None, 0, None
        try:
            async for k, chunk_usage in stream(prompt, m):
                last, tokens = lat.chunk(submitted, last, time.perf_counter(), k), tokens + k
                usage = chunk_usage if chunk_usage is not None else usage
            if tokens != m or usage != m:
                raise ValueError(f"{tokens} tokens, usage {usage}, max_tokens {m}")
            return tokens, None
        except Exception as e:
            cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ is not None else ""
            return tokens, f"{type(e).__name__}: {e}{cause}"

    start = time.perf_counter()
    done = await asyncio.gather(*map(complete, prompts, max_tokens, arrivals or [0.0] * len(prompts)))
    errors = [e for _, e in done if e is not None]
    return {"tokens": sum(t for t, _ in done), "failed_requests": len(errors), "errors": errors[:3],
            "seconds": time.perf_counter() - start, "ttft": lat.ttft, "itl": lat.itl}


async def http_client_process(url: str, job: dict) -> dict:
    """An http client (benchmarks_common.run_workers): warm up, ready, go, then its requests:
    at once, or at the job's arrival times."""
    async with contextlib.AsyncExitStack() as stack:
        if job["client"] == "httpx":
            import httpx

            client = await stack.enter_async_context(httpx.AsyncClient(
                timeout=600, limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)))
            stream = httpx_chunks(client, url, job["model"])
        else:
            from openai import AsyncOpenAI

            client = await stack.enter_async_context(AsyncOpenAI(base_url=url, api_key="none", max_retries=0))
            stream = openai_chunks(client, job["model"])
        await http_requests(stream, job["prompts"], [2] * len(job["prompts"]))
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        cpu = time.process_time()
        result = await http_requests(stream, job["prompts"], job["max_tokens"], job.get("arrivals"))
        return {**result, "busy": (time.process_time() - cpu) / result["seconds"]}


def http(args, prompts, max_tokens) -> dict:
    """The http burst and the http-poisson rates, as args.parts asks, through one `headrace serve`."""
    n = args.http_clients
    results = {}
    with api_server(args) as url:
        def clients(arrivals=None, on_go=None) -> dict:
            jobs = [{"model": args.model, "client": args.client, "prompts": prompts[i::n],
                     "max_tokens": max_tokens[i::n]} for i in range(n)]
            if arrivals is not None:
                for i, job in enumerate(jobs):
                    job["arrivals"] = arrivals[i::n]
            seconds, answers = run_workers([sys.executable, __file__, "--http-client", url], jobs, on_go)
            return {"seconds": seconds, "tokens": sum(a["tokens"] for a in answers),
                    "failed_requests": sum(a["failed_requests"] for a in answers),
                    "errors": [e for a in answers for e in a["errors"]][:5],
                    "ttft": [t for a in answers for t in a.get("ttft", ())],
                    "itl": [t for a in answers for t in a.get("itl", ())],
                    "client_busy": max(a["busy"] for a in answers)}

        if "http" in args.parts:
            results["http"] = clients()
            log("http", results["http"])
        if "http-poisson" in args.parts:
            results["http-poisson"] = []
            metrics_url = url.removesuffix("/v1") + "/metrics"  # every API server's frontend stats, merged
            for rate, i in ((rate, i) for rate in args.rates for i in range(args.poisson_runs)):
                totals, name = {}, f"http-poisson {rate:g} req/s{run_name(i, args)}"
                with host_profile(args.py_spy, name, deferred=True) as go:
                    def on_go():
                        totals["before"] = page_totals(metrics_url)
                        go()
                    r = clients(arrival_times(len(prompts), rate), on_go)
                ttft, itl = r.pop("ttft"), r.pop("itl")
                results["http-poisson"].append({"path": f"headrace serve (HTTP, {args.client})", "rate": rate,
                                                "requests": len(prompts) - r["failed_requests"], **r,
                                                "ttft_ms": percentiles(ttft), "itl_ms": percentiles(itl),
                                                "ttft_mean_ms": mean_ms(ttft),
                                                "frontend_ms": frontend_spans(totals["before"],
                                                                              page_totals(metrics_url))})
                number_runs(results["http-poisson"])
                log(name, results["http-poisson"][-1])
    return results


# ---- report ----

def log(name: str, result: dict) -> None:
    counts = (("dead_streams", "streams with EngineDeadError"), ("failed_requests", "failed requests"))
    notes = "".join(f"; {label}: {result[k]}" for k, label in counts if k in result)
    print(f"{name}: {result['tokens']} output tokens in {result['seconds']:.2f} s = "
          f"{tok_s(result):.0f} tok/s{notes}", flush=True)


def tok_s(result: dict) -> float:
    return result["tokens"] / result["seconds"]


def path_rows(results: dict, expected: int, args) -> list[dict]:
    """(path, tok/s, ratio to in-process, notes) of every throughput path measured."""
    rows = []
    inproc = results.get("inproc")
    peer = tok_s(inproc) if inproc else None

    def row(path, value, notes, runs):
        short = [f"{r['tokens']} of {expected} tokens" for r in runs if r["tokens"] != expected]
        rows.append({"path": path, "tok_s": value, "ratio": value / peer if peer and value else None,
                     "notes": "; ".join(short + notes), "runs": runs})

    if inproc:
        notes = [f"{inproc['steps']} steps"]
        if "floor_seconds" in inproc:
            floor = inproc["floor_seconds"]
            notes.append(f"floor {floor:.2f} s = {inproc['tokens'] / floor:.0f} tok/s, time / floor "
                         f"{inproc['seconds'] / floor:.2f} (copy {inproc['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
                         f"bf16 matmul {inproc['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s)")
        row("in-process EngineCore (peer)", peer, notes, [inproc])
    plain = burst = None
    if "burst" in results:
        plain, notes = median_of_runs(results["burst"])
        row("AsyncEngine.from_model, 1 frontend", plain, notes, results["burst"])
        burst = plain
    if "burst-logprobs" in results:
        value, notes = median_of_runs(results["burst-logprobs"])
        row(f"AsyncEngine.from_model, 1 frontend, logprobs={NUM_LOGPROBS}", value,
            notes + of_no_logprobs(value, plain), results["burst-logprobs"])
    if "scaleout" in results:
        label = f"AsyncEngine.connect, {args.frontends} frontend processes"
        runs = results["scaleout"]  # without, then with logprobs
        plain, notes = median_of_runs(runs[:1])
        row(label, plain, notes, runs[:1])
        value, notes = median_of_runs(runs[1:])
        row(f"{label}, logprobs={NUM_LOGPROBS}", value, notes + of_no_logprobs(value, plain), runs[1:])
    if "http" in results:
        r = results["http"]
        value, of_burst = tok_s(r), tok_s(r) / burst if burst else None
        notes = [f"{of_burst:.3f} of burst (>= 0.9: {'yes' if of_burst >= 0.9 else 'no'})"] if of_burst else []
        notes.append(f"busiest client process {r['client_busy']:.2f} CPU s / s")
        if r["failed_requests"]:
            notes.append(f"{r['failed_requests']} failed requests, first: {r['errors'][0]}")
        row(f"headrace serve, {args.client} client (--api-servers {args.api_servers}, "
            f"--http-clients {args.http_clients})", value, notes, [r])
        rows[-1]["of_burst"] = of_burst
    return rows


def of_no_logprobs(value: float | None, plain: float | None) -> list[str]:
    return [f"{value / plain:.3f} of no logprobs"] if value and plain else []


def median_of_runs(runs: list[dict]) -> tuple[float | None, list[str]]:
    """The median tok/s of the runs no EngineDeadError cut short, and notes on all."""
    good = [tok_s(r) for r in runs if not r["dead_streams"]]
    notes = []
    if len(runs) > 1:
        notes.append(f"median of {len(good)}: " + ", ".join(f"{v:.0f}" for v in good))
    if len(runs) > 1 or not good:
        notes.append(f"EngineDeadError in {len(runs) - len(good)} of {len(runs)} runs")
    return (statistics.median(good) if good else None), notes


def run_name(i: int, args) -> str:
    return f" run {i + 1}" if args.poisson_runs > 1 else ""


def number_runs(runs: list[dict]) -> None:
    """Number the last of a Poisson part's runs among those at its rate (1, 2, ...)."""
    runs[-1]["run"] = sum(r["rate"] == runs[-1]["rate"] for r in runs)


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def median_row(runs: list[dict]) -> dict:
    """One path's runs at one rate as one row: the median over the runs of each figure."""
    def each(key, size):  # the median of each position of a list figure (p50, p90, p99)
        lists = [r[key] for r in runs if r[key]]
        return [statistics.median(v[i] for v in lists) for i in range(size)] if lists else None

    first = runs[0]
    return {"path": first["path"], "rate": first["rate"], "run": f"median of {len(runs)} runs",
            "requests": min(r["requests"] for r in runs), "tok_s": _median([tok_s(r) for r in runs]),
            "ttft_ms": each("ttft_ms", 3), "itl_ms": each("itl_ms", 3),
            "ttft_mean_ms": _median([r["ttft_mean_ms"] for r in runs]),
            "client_busy": _median([r.get("client_busy") for r in runs]),
            "frontend_ms": {k: _median([r["frontend_ms"][k] for r in runs]) for k in first["frontend_ms"]},
            "dead_streams": sum(r.get("dead_streams", 0) for r in runs),
            "failed_requests": sum(r.get("failed_requests", 0) for r in runs),
            "errors": [e for r in runs for e in r.get("errors", ())][:5]}


def poisson_rows(results: list[dict]) -> list[dict]:
    """poisson's and http-poisson's runs, with notes on their targets, and where a rate has several runs a
    row of their medians a path; an HTTP run is set against AsyncEngine's run of the same number at the
    same rate, an HTTP median row against AsyncEngine's."""
    groups = {}
    for r in results:
        groups.setdefault((r["path"], r["rate"]), []).append(r)
    medians = [median_row(runs) for runs in groups.values() if len(runs) > 1]
    engine = {(r["rate"], r.get("run")): r for r in results + medians if r["path"] == "AsyncEngine"}
    rows = []
    for r in results + medians:
        ttft, itl = r["ttft_ms"], r["itl_ms"]
        notes = []
        if r.get("dead_streams"):
            notes.append(f"EngineDeadError in {r['dead_streams']} streams")
        if r.get("failed_requests"):
            notes.append(f"{r['failed_requests']} failed requests, first: {r['errors'][0]}")
        peer = engine.get((r["rate"], r.get("run"))) if r["path"] != "AsyncEngine" else None
        if peer and ttft and itl and peer["ttft_ms"] and peer["itl_ms"]:
            for name, mine, theirs in (("TTFT", ttft, peer["ttft_ms"]), ("ITL", itl, peer["itl_ms"])):
                ratio = mine[2] / theirs[2]
                notes.append(f"{name} p99 {ratio:.2f}x AsyncEngine's (<= 1.5: {'yes' if ratio <= 1.5 else 'no'})")
        elif ttft and itl:
            notes.append(f"TTFT p99 < 200 ms: {'yes' if ttft[2] < 200 else 'no'}")
            notes.append(f"ITL p99 / p50 = {itl[2] / itl[0]:.2f} (< 3: {'yes' if itl[2] < 3 * itl[0] else 'no'})")
        several = len(groups[r["path"], r["rate"]]) > 1
        number = r.get("run")  # an int, or "median of N runs"
        label = r["path"] + (f", {number}" if isinstance(number, str) else f", run {number}" if several else "")
        rows.append({**r, "tok_s": r["tok_s"] if "tok_s" in r else tok_s(r), "label": label, "notes": "; ".join(notes)})
    return rows


def print_tables(paths: list[dict], poisson_results: list[dict]) -> None:
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    if paths:
        print("\n| path | output tok/s | of in-process | notes |\n| --- | ---: | ---: | --- |")
        for r in paths:
            print(f"| {r['path']} | {fmt(r['tok_s'], '.0f')} | {fmt(r['ratio'], '.3f')} | {r['notes']} |")
    if poisson_results:
        print("\n| path | rate req/s | requests | output tok/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms "
              "| TTFT mean ms: client / frontend (queued + prefill) | frontend TTFT p99 ms, at most "
              "| busiest client process, CPU s / s | notes |\n"
              "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |")
        for r in sorted(poisson_results, key=lambda r: r["rate"]):
            ttft, itl = (" / ".join(f"{v:.1f}" for v in p) if p else "-" for p in (r["ttft_ms"], r["itl_ms"]))
            f = r["frontend_ms"]
            means = (f"{fmt(r['ttft_mean_ms'], '.1f')} / {fmt(f['ttft'], '.1f')} "
                     f"({fmt(f['queue'], '.1f')} + {fmt(f['prefill'], '.1f')})")
            print(f"| {r['label']} | {r['rate']:g} | {r['requests']} | {r['tok_s']:.0f} | {ttft} | {itl} | {means} "
                  f"| {fmt(f.get('ttft_p99'), 'g')} | {fmt(r.get('client_busy'), '.2f')} | {r['notes']} |")


# ---- main ----

def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--frontends", type=int, default=2, help="frontend processes of scaleout")
    parser.add_argument("--api-servers", type=int, default=2, help="API server processes of http")
    parser.add_argument("--http-clients", type=int, default=8, help="client processes of http")
    parser.add_argument("--client", default="openai", choices=["openai", "httpx"],
                        help="what the http clients send with: the openai client, or bare httpx parsing each chunk "
                             "with json")
    parser.add_argument("--prompts", default="text", choices=["ids", "text"],
                        help="what every part but inproc sends: the text the ids decode to (as an application "
                             "sends it), or the token ids")
    parser.add_argument("--rates", default="8,24", help="Poisson arrival rates, requests/s")
    parser.add_argument("--repeats", type=int, default=1, help="runs of burst-logprobs")
    parser.add_argument("--poisson-runs", type=int, default=1, help="runs of each rate in poisson and http-poisson")
    parser.add_argument("--loop-load", type=float, default=0.0, metavar="MS",
                        help="block the frontends' event loops for MS ms every 10 ms")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="of every engine")
    parser.add_argument("--data-parallel-size", type=int, default=1, help="cores behind headrace serve (http only)")
    parser.add_argument("--model", default=None, help="default: the Qwen3-0.6B shape on CUDA, the demo on a CPU")
    parser.add_argument("--max-prompt", type=int, default=1024, help="cut prompts to this many tokens")
    parser.add_argument("--max-output", type=int, default=1024, help="cut max_tokens to this")
    parser.add_argument("--py-spy", type=float, default=0.0, metavar="SECONDS",
                        help="sample every process of each poisson and http-poisson run for its first SECONDS "
                             "with py-spy (on PATH), and print where each kind's busy time went")
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--frontend", default=None, help=argparse.SUPPRESS)  # a scaleout frontend process
    parser.add_argument("--http-client", default=None, help=argparse.SUPPRESS)  # an http client process
    args = parser.parse_args()
    args.parts = args.parts.split(",")
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    missing = [m for m in (args.client, "starlette", "uvicorn", "httptools") if importlib.util.find_spec(m) is None]
    if set(HTTP_PARTS) & set(args.parts) and missing:
        parser.error(f"the http part needs {', '.join(missing)} (and their dependencies); or leave it out of --parts")
    for name in ("repeats", "poisson_runs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} takes a count >= 1, got {getattr(args, name)}")
    if not args.py_spy >= 0:
        parser.error(f"--py-spy takes seconds >= 0, got {args.py_spy}")
    args.rates = [float(r) for r in args.rates.split(",")]
    return args


def main() -> None:
    args = parse_args()
    if args.frontend:
        worker_answer(run(frontend_process(args.frontend, json.loads(sys.stdin.readline()))))
        return
    if args.http_client:
        worker_answer(run(http_client_process(args.http_client, json.loads(sys.stdin.readline()))))
        return
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # unwind as on Ctrl-C, stopping what was started
    import torch

    from headrace.checkpoint.config import ModelConfig
    from headrace.testing import demo_checkpoint

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.model is None:
        args.model = str(qwen3_06b_checkpoint() if args.device.startswith("cuda") else demo_checkpoint())
    config = ModelConfig.from_dir(args.model)
    args.max_model_len = min(4096, config.max_position_embeddings)
    prompts, max_tokens = requests(args, config.vocab_size)
    expected = sum(max_tokens)
    print(f"{args.model} on {args.device}: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
          f"{expected} output tokens; max_model_len {args.max_model_len}; loop load {args.loop_load:g} ms "
          f"every 10 ms", flush=True)
    results = {}
    if "inproc" in args.parts:
        results["inproc"] = in_process(args, prompts, max_tokens)
        log("inproc", results["inproc"])
    sent = prompts
    if args.prompts == "text":  # what the frontends get: each prompt's ids decoded; they tokenize it again
        from headrace import envs
        from headrace.checkpoint.tokenizer import load_tokenizer, prepare_tokenizer

        tokenizer = load_tokenizer(prepare_tokenizer(args.model, envs.cache_dir()))  # the frontends' own
        # random ids decode to text that tokenizes to a different count: cut that to the ids' count, once
        sent = [tokenizer.decode(tokenizer.encode(tokenizer.decode(p), add_special_tokens=False)[:len(p)])
                for p in prompts]
        print(f"prompts sent as text: {sum(len(tokenizer.encode(t, add_special_tokens=False)) for t in sent)} "
              f"tokens once tokenized again", flush=True)
    results.update(run(spawned_engine_parts(args, sent, max_tokens)))
    if "scaleout" in args.parts:
        results["scaleout"] = scale_out(args, sent, max_tokens)
    if set(HTTP_PARTS) & set(args.parts):
        results.update(http(args, sent, max_tokens))
    paths = path_rows(results, expected, args)
    poisson_results = poisson_rows(results.get("poisson", []) + results.get("http-poisson", []))
    print_tables(paths, poisson_results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": args.device, "num_requests": len(prompts),
                       "prompt_tokens": sum(map(len, prompts)), "output_tokens": expected,
                       "prompts_sent_as": args.prompts, "max_model_len": args.max_model_len,
                       "loop_load_ms": args.loop_load, "client": args.client,
                       "api_servers": args.api_servers, "http_clients": args.http_clients,
                       "paths": paths, "poisson": poisson_results}, f, indent=1)


if __name__ == "__main__":
    main()
