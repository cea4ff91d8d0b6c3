"""A frontend in its own OS process, driven by the streaming tests.

    python tests/frontend_worker.py stream ADDRESS PROMPTS_JSON   # stream, print results as JSON
    python tests/frontend_worker.py hang ADDRESS                  # start a long request, then wait forever
    python tests/frontend_worker.py spawn MODEL                   # from_model, print the core's pid, wait
"""
from __future__ import annotations

import asyncio
import json
import sys

from headrace import AsyncEngine, RequestOutputKind, SamplingParams


async def stream(address: str, prompts: list) -> None:
    async with AsyncEngine.connect(address) as engine:
        async def one(i, prompt):
            sp = SamplingParams(temperature=0, max_tokens=24, output_kind=RequestOutputKind.DELTA)
            deltas, ids = [], []
            async for out in engine.generate(prompt, sp, request_id=str(i)):  # same ids in every worker
                deltas.append(out.outputs[0].text)
                ids += out.outputs[0].token_ids
                assert out.request_id == str(i)
            return {"token_ids": ids, "deltas": deltas, "finish_reason": out.outputs[0].finish_reason}

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    print(json.dumps(results), flush=True)


async def hang(address: str) -> None:
    """Submit 64 long requests, say so once the first streams, then keep streaming."""
    engine = AsyncEngine.connect(address)
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    first = asyncio.Event()

    async def one(i):
        async for _ in engine.generate([5, 6, 7, 8 + i], sp):
            first.set()

    tasks = [asyncio.create_task(one(i)) for i in range(64)]
    await first.wait()
    print("streaming", flush=True)
    await asyncio.gather(*tasks)


async def spawn(model: str) -> None:
    engine = AsyncEngine.from_model(model, max_model_len=128)
    await engine.start()
    print(engine._process.proc.pid, flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    mode, arg = sys.argv[1], sys.argv[2]
    if mode == "stream":
        asyncio.run(stream(arg, json.loads(sys.argv[3])))
    elif mode == "hang":
        asyncio.run(hang(arg))
    else:
        asyncio.run(spawn(arg))
