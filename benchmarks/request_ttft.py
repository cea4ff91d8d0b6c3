"""One request at a time: what a request's own way costs, AsyncEngine against `headrace serve`.

    python3 benchmarks/request_ttft.py [--requests 40] [--prompt-len 200] [--api-servers 1,2]
                                       [--device auto] [--model DIR]

Each request is a streamed completion of a random token-id prompt with
max_tokens 2 (temperature 0.6, ignore_eos), sent after the previous one has
finished, so no other stream shares the engine, the API server or the client.
TTFT is from sending to the first chunk that carries text. The paths:
- engine: AsyncEngine.from_model in this process, generate() with the ids;
- httpx: `headrace serve --api-servers N`, POST /v1/completions streamed
  through a bare httpx client (its lines read as they come);
- openai: the same server through the openai client's AsyncOpenAI.
The first 5 requests of each path warm it and are not counted; the engine
path runs first and again last, so that its two figures bracket the others. Under load
(benchmarks/serving.py's http-poisson) a request also waits behind the other
streams' chunks; this measures what is left without them. The model is the
Qwen3-0.6B shape with random bf16 weights on CUDA, the demo checkpoint on a CPU.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from types import SimpleNamespace

WARM = 5


def report(name: str, seconds: list[float]) -> None:
    ms = sorted(1e3 * s for s in seconds[WARM:])
    print(f"{name:<28} TTFT ms p50 {statistics.median(ms):7.2f}  min {ms[0]:7.2f}  "
          f"p90 {ms[int(0.9 * (len(ms) - 1))]:7.2f}", flush=True)


async def first_text_seconds(prompts: list[list[int]], stream_of) -> list[float]:
    """For each prompt in turn: seconds from the call to the first item of stream_of(prompt) (an async
    iterator of whether each item carries text) that does, the stream read to its end."""
    out = []
    for p in prompts:
        sent, first = time.perf_counter(), None
        async for has_text in stream_of(p):
            if first is None and has_text:
                first = time.perf_counter() - sent
        out.append(first)
    return out


async def engine_path(model: str, engine_args: dict, prompts: list[list[int]]) -> list[float]:
    from headrace import SamplingParams
    from headrace.frontend.async_engine import AsyncEngine

    engine = AsyncEngine.from_model(model, **engine_args)
    params = SamplingParams(max_tokens=2, temperature=0.6, ignore_eos=True)

    async def stream_of(p):
        async for o in engine.generate({"prompt_token_ids": p}, params):
            yield bool(o.outputs and o.outputs[0].token_ids)

    try:
        return await first_text_seconds(prompts, stream_of)
    finally:
        await engine.aclose()


async def httpx_path(url: str, model: str, prompts: list[list[int]]) -> list[float]:
    import httpx

    async with httpx.AsyncClient(timeout=120) as client:
        async def stream_of(p):
            body = {"model": model, "prompt": p, "max_tokens": 2, "stream": True, "ignore_eos": True,
                    "temperature": 0.6}
            async with client.stream("POST", url + "/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    yield line.startswith("data: ") and '"text"' in line

        return await first_text_seconds(prompts, stream_of)


async def openai_path(url: str, model: str, prompts: list[list[int]]) -> list[float]:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="unused")

    async def stream_of(p):
        stream = await client.completions.create(model=model, prompt=p, max_tokens=2, temperature=0.6, stream=True,
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            yield bool(chunk.choices and chunk.choices[0].text)

    try:
        return await first_text_seconds(prompts, stream_of)
    finally:
        await client.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--api-servers", default="1,2", help="comma list: the servers to time")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model", default=None, help="default: the Qwen3-0.6B shape on CUDA, the demo on a CPU")
    args = parser.parse_args()
    if args.requests <= WARM:
        parser.error(f"--requests must exceed the {WARM} warm-up requests")
    if args.prompt_len < 1:
        parser.error("--prompt-len must be at least 1")
    try:
        servers = [int(v) for v in args.api_servers.split(",")]
    except ValueError:
        parser.error(f"--api-servers takes a comma list of counts, got {args.api_servers!r}")
    if any(v < 1 for v in servers):
        parser.error("--api-servers counts must be at least 1")
    import torch
    from benchmarks_common import qwen3_06b_checkpoint
    from serving import api_server

    from headrace.checkpoint.config import ModelConfig
    from headrace.testing import demo_checkpoint

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    model = args.model or str(qwen3_06b_checkpoint() if device.startswith("cuda") else demo_checkpoint())
    config = ModelConfig.from_dir(model)
    max_model_len = min(4096, config.max_position_embeddings)
    if args.prompt_len + 2 > max_model_len:
        parser.error(f"--prompt-len leaves no room in max_model_len {max_model_len}")
    rng = random.Random(0)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    engine_args = {"device": device, "max_model_len": max_model_len, "enable_prefix_caching": False,
                   "max_num_seqs": 1}
    print(f"{model} on {device}: {args.requests} requests of {args.prompt_len} prompt tokens, one at a time",
          flush=True)
    report("engine (AsyncEngine)", asyncio.run(engine_path(model, engine_args, prompts)))
    for n in servers:
        # serving.api_server's fields; its engine takes max_num_seqs from num_requests, as engine_args above
        serve = SimpleNamespace(model=model, device=device, max_model_len=max_model_len, num_requests=1,
                                tensor_parallel_size=1, api_servers=n, data_parallel_size=1)
        with api_server(serve) as url:
            report(f"httpx, {n} API server(s)", asyncio.run(httpx_path(url, model, prompts)))
            report(f"openai, {n} API server(s)", asyncio.run(openai_path(url, model, prompts)))
    report("engine (AsyncEngine), again", asyncio.run(engine_path(model, engine_args, prompts)))


if __name__ == "__main__":
    main()
