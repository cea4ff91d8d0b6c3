"""Data parallelism: one frontend over several engine cores."""
from __future__ import annotations

import asyncio
import os
import re
import signal

import httpx
import pytest

from headrace import AsyncEngine, EngineDeadError, RequestOutputKind, SamplingParams
from tests.conftest import hf_greedy
from tests.cores import wait_until_idle
from tests.servers import Serve

PROMPTS = [f"The river {i} is low today." for i in range(8)]


async def stream(engine, prompt, sp):
    ids = []
    async for out in engine.generate(prompt, sp):
        ids += out.outputs[0].token_ids
    return ids


def test_requests_spread_over_two_cores_and_match_transformers(checkpoint, hf_model):
    path = checkpoint("qwen3")
    sp = SamplingParams(temperature=0, max_tokens=12, output_kind=RequestOutputKind.DELTA)

    async def main():
        async with AsyncEngine.from_model(str(path), data_parallel_size=2, max_model_len=256, block_size=8) as engine:
            assert len(set(engine.addresses)) == 2
            got = await asyncio.gather(*(stream(engine, p, sp) for p in PROMPTS))
            steps = []
            for address in engine.addresses:  # each core served some of them
                async with AsyncEngine.connect(address) as one:
                    steps.append((await wait_until_idle(one)).num_steps)
            total = await engine.stats()
            return engine.tokenizer, got, steps, total

    tok, got, steps, total = asyncio.run(main())
    model = hf_model(path)
    assert got == [hf_greedy(model, tok.encode(p), 12) for p in PROMPTS]
    assert all(n > 0 for n in steps)
    assert total.num_steps == sum(steps) and total.num_blocks > 0


def test_a_dead_core_fails_its_own_requests_only(checkpoint):
    path = checkpoint("qwen3")
    long = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def main():
        engine = AsyncEngine.from_model(str(path), data_parallel_size=2, max_model_len=1024)
        async with engine:
            states = [await engine.add_request(p, long) for p in PROMPTS[:4]]
            assert sorted(s.core for s in states) == [0, 0, 1, 1]  # the least loaded core takes the next request
            os.kill(engine._processes[1].proc.pid, signal.SIGKILL)

            async def drain(state):
                n = 0
                async for out in engine.outputs(state):
                    n += len(out.outputs[0].token_ids)
                return n

            results = await asyncio.gather(*(drain(s) for s in states), return_exceptions=True)
            with pytest.raises(EngineDeadError):
                await engine.add_request("one more", long)
            return [s.core for s in states], results

    cores, results = asyncio.run(main())
    for core, result in zip(cores, results):
        if core == 1:
            assert isinstance(result, EngineDeadError)
        else:
            assert result == 900


def test_serve_spreads_over_two_cores(checkpoint):
    s = Serve(checkpoint("qwen3"), "--data-parallel-size", "2")
    try:
        with httpx.Client(timeout=60) as http:
            for i in range(6):
                r = http.post(s.base_url + "/completions", json={"prompt": f"river {i}", "max_tokens": 4})
                assert r.status_code == 200, r.text
        _, page = s.get("/metrics")
        engines = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'headrace:generation_tokens_total\{engine="(\w+)"[^}]*\} (\S+)', page.decode())}
        assert len(engines) == 2 and all(v > 0 for v in engines.values()), engines
    finally:
        assert s.stop() == 0


def test_llm_refuses_data_parallel_with_a_pointer(checkpoint):
    from headrace import LLM

    with pytest.raises(TypeError, match="AsyncEngine.from_model"):
        LLM(checkpoint("qwen3"), data_parallel_size=2)


def test_a_core_takes_its_gpus_from_its_data_parallel_rank(monkeypatch):
    """Core r with tensor_parallel_size t starts at GPU first + r * t, first from its device; the CPU
    stays the CPU; a rank that is not a non-negative integer is refused."""
    import torch

    from headrace.config import EngineArgs
    from headrace.core import engine

    cpu = EngineArgs(model="m", device="cpu")
    assert engine._place(cpu, 3) is cpu
    monkeypatch.setattr(engine, "resolve_device", lambda name: torch.device("cuda:1" if name == "cuda:1" else "cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert engine._place(EngineArgs(model="m"), 0).device == "auto"
    assert engine._place(EngineArgs(model="m"), 1).device == "cuda:1"
    assert engine._place(EngineArgs(model="m", device="cuda:1", tensor_parallel_size=2), 2).device == "cuda:5"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # a rank past the machine's GPUs, named
    with pytest.raises(ValueError, match=r"data-parallel rank 1 \(tensor_parallel_size=2.*cuda:2 to cuda:3.* 2 GPU"):
        engine._place(EngineArgs(model="m", tensor_parallel_size=2), 1)
    for bad in (-1, 1.0, True, "1"):
        with pytest.raises(ValueError, match="data_parallel_rank"):
            engine._place(cpu, bad)


def test_a_core_that_cannot_start_says_why_and_no_core_is_left(checkpoint):
    """The cores' KV pool cannot hold a sequence: the error a core raised reaches the caller, and no core
    is left running."""
    from tests.test_tensor_parallel import _children

    async def main():
        async with AsyncEngine.from_model(str(checkpoint("qwen3")), data_parallel_size=2, device="cpu",
                                          max_model_len=256, num_kv_blocks=4):
            pass

    with pytest.raises(EngineDeadError, match=r"failed to start: ConfigError: num_kv_blocks=4 cannot hold one "
                                              r"sequence of max_model_len=256"):
        asyncio.run(main())
    assert not _children(os.getpid(), "headrace")
