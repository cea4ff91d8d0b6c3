"""The frontend's cost per streamed token, without a core: what one frontend
process can keep up with.

    python benchmarks/frontend_cost.py [--model DIR] [--num-requests 256] [--tokens 256]

Encoded StepOutputs frames, one per step with one new token for every
request (random ids the tokenizer knows; with --logprobs N, N+1 packed
logprob columns as the core sends them), are decoded and handed to an
AsyncEngine's receive side exactly as its I/O thread would hand them over,
while one consumer task per request iterates generate()'s stream (DELTA,
reading each output's text, ids and, with logprobs, every position's
dict). Prints microseconds of frontend time per token for each case, and
the output tokens/s one frontend process could therefore take; a profile
of one case with --profile.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import random
import time

import numpy as np
from headrace import AsyncEngine, RequestOutputKind, SamplingParams, envs
from headrace.checkpoint.tokenizer import load_tokenizer, prepare_tokenizer
from headrace.core.protocol import EngineCoreOutput, StepOutputs, encode, from_core_decoder, pack_floats, pack_ids
from headrace.frontend.async_engine import run
from headrace.frontend.output_processor import TokenText
from headrace.frontend.router import Router


def frames(num_requests: int, num_tokens: int, vocab: int, num_logprobs: int | None) -> list[bytes]:
    """One encoded StepOutputs per step; the last step finishes every request."""
    rng = np.random.default_rng(0)
    out = []
    for step in range(num_tokens):
        tokens = rng.integers(5, vocab, num_requests)
        outs = []
        for i, t in enumerate(tokens.tolist()):
            o = EngineCoreOutput(request_id=str(i), new_token_ids=pack_ids([t]),
                                 finish_reason="length" if step == num_tokens - 1 else None)
            if num_logprobs is not None:
                k = 1 + num_logprobs
                o.logprob_token_ids = pack_ids([t, *rng.integers(5, vocab, k - 1).tolist()])
                o.logprobs = pack_floats(-rng.random(k))
                o.sampled_ranks, o.sampled_logprobs = pack_ids([1]), pack_floats([-0.5])
            outs.append(o)
        out.append(encode(StepOutputs(outputs=outs, timestamp=time.time())))
    return out


async def stream_all(engine: AsyncEngine, encoded: list[bytes], num_requests: int, sp: SamplingParams) -> int:
    async def consume(state):
        n = 0
        async for out in engine.outputs(state):
            c = out.outputs[0]
            n += len(c.token_ids)
            if c.logprobs is not None:
                for entry in c.logprobs:
                    n += 0 * len(entry)
        return n

    states = [await engine.submit(None, [5, 6, 7], sp, request_id=str(i)) for i in range(num_requests)]
    tasks = [asyncio.create_task(consume(s)) for s in states]
    for frame in encoded:
        await engine._on_outputs(from_core_decoder.decode(frame), engine._clients[0])
        await asyncio.sleep(0)
    return sum(await asyncio.gather(*tasks))


class _NullClient:
    """Stands in for the I/O thread's client: takes what the engine sends, drops it."""

    dead = None

    def add(self, *args) -> None:
        pass

    def abort(self, ids) -> None:
        pass


def measure(engine: AsyncEngine, encoded, num_requests: int, sp: SamplingParams, profile: bool) -> float:
    prof = cProfile.Profile() if profile else None

    async def main():
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        n = await stream_all(engine, encoded, num_requests, sp)
        elapsed = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
        assert n == num_requests * len(encoded), n
        return elapsed / n

    per_token = run(main())
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return per_token


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a checkpoint whose tokenizer to use (default: the demo's)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--profile", default=None, help="profile this case: plain, logprobs5")
    args = parser.parse_args()
    if args.model is None:
        from headrace.testing import demo_checkpoint

        args.model = str(demo_checkpoint())
    tokenizer = load_tokenizer(prepare_tokenizer(args.model, envs.cache_dir()))  # what frontends use
    engine = AsyncEngine.connect("ipc:///unused")
    client = _NullClient()
    engine.tokenizer, engine._clients, engine._load = tokenizer, [client], [0]
    engine._router = Router([16], [1 << 20], "least_loaded")  # what the handshake would make for one core
    engine.info = type("Info", (), {"vocab_size": len(tokenizer), "max_model_len": 1 << 20})()
    t0 = time.perf_counter()
    engine._token_text = TokenText(tokenizer, len(tokenizer))
    print(f"tokenizer of {len(tokenizer)} tokens; logprob text table built in {time.perf_counter() - t0:.3f}s")
    random.seed(0)
    cases = {"plain": None, "logprobs5": 5}
    for name, num_logprobs in cases.items():
        encoded = frames(args.num_requests, args.tokens, len(tokenizer), num_logprobs)
        sp = SamplingParams(max_tokens=args.tokens, logprobs=num_logprobs, output_kind=RequestOutputKind.DELTA)
        per_token = measure(engine, encoded, args.num_requests, sp, args.profile == name)
        print(f"{name:>10}: {per_token * 1e6:6.2f} us per token -> {1 / per_token:8.0f} tokens/s in one frontend")


if __name__ == "__main__":
    main()
