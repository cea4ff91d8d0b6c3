"""The streaming frontend under load: liveness that a busy event loop cannot
break, merged outputs for consumers slower than the core, logprobs at load,
and a step's outputs handled in chunks that let the loop breathe.

The load tests load the event loop too: a coroutine that blocks it over and
over runs next to the streams, as a busy application would."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest

from headrace import AsyncEngine, EngineDeadError, RequestOutputKind, SamplingParams
from headrace.core.protocol import EngineCoreOutput, StepOutputs, pack_ids
from headrace.frontend.output_processor import RequestState, TokenText
from headrace.testing import build_tokenizer
from tests.conftest import hf_greedy, hf_logprobs
from tests.cores import seconds_until_dead, start_core, stop, wait_until_idle

PROMPTS = [[5 + i, 6 + 2 * i, 7 + 3 * i, 8] for i in range(8)]


@pytest.fixture
def core(checkpoint, tmp_path):
    proc, address = start_core(checkpoint("qwen3"), f"ipc://{tmp_path}/core.sock", "--max-num-seqs", "64")
    yield proc, address
    stop(proc)


async def hog_loop(block_s: float, every_s: float, stop_event: asyncio.Event) -> int:
    """Block the event loop for block_s out of every every_s (a busy application); returns the blocks."""
    n = 0
    while not stop_event.is_set():
        end = time.monotonic() + block_s
        while time.monotonic() < end:  # holds the GIL, as Python work does
            pass
        n += 1
        await asyncio.sleep(every_s - block_s)
    return n


async def collect(gen) -> list:
    return [o async for o in gen]


def test_a_blocked_event_loop_keeps_its_core(core, checkpoint, hf_model):
    """The frontend's loop stops for 10 s (time.sleep) and then spins for 4 s
    holding the GIL, both longer than the 3 s heartbeat timeout: neither the
    core nor the frontend declares the other dead, and every stream finishes
    with the reference tokens."""
    proc, address = core
    model = hf_model(checkpoint("qwen3"))
    sp = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def main():
        async with AsyncEngine.connect(address) as engine:
            gens = [engine.generate(p, sp) for p in PROMPTS]
            firsts = [await g.__anext__() for g in gens]
            time.sleep(10)
            end = time.monotonic() + 4
            while time.monotonic() < end:
                pass
            rests = await asyncio.gather(*(collect(g) for g in gens))
            s = await wait_until_idle(engine)
            assert s.num_frontends == 1
            return [[f, *r] for f, r in zip(firsts, rests)]

    streams = asyncio.run(main())
    assert proc.poll() is None
    for prompt, outs in zip(PROMPTS, streams):
        assert sum((o.outputs[0].token_ids for o in outs), []) == hf_greedy(model, prompt, 100)
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert len(outs) < 20  # the outputs made while the loop slept came merged


def test_streams_with_logprobs_under_a_loaded_loop(core, checkpoint, hf_model):
    """64 DELTA streams with logprobs=5 while the loop is blocked 40 ms of every
    50: no false EngineDeadError, and tokens and logprobs match transformers."""
    _, address = core
    model = hf_model(checkpoint("qwen3"))
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, logprobs=5,
                        output_kind=RequestOutputKind.DELTA)

    async def main():
        async with AsyncEngine.connect(address) as engine:
            stop_hog = asyncio.Event()
            hog = asyncio.create_task(hog_loop(0.04, 0.05, stop_hog))
            streams = await asyncio.gather(*(collect(engine.generate(PROMPTS[i % 8], sp)) for i in range(64)))
            stop_hog.set()
            assert await hog >= 3  # it really ran alongside
            await wait_until_idle(engine)
            return streams

    streams = asyncio.run(main())
    greedy = [hf_greedy(model, prompt, 200) for prompt in PROMPTS[:8]]  # each prompt's, once
    for i, outs in enumerate(streams):
        prompt = PROMPTS[i % 8]
        ids = sum((o.outputs[0].token_ids for o in outs), [])
        lps = [e for o in outs for e in o.outputs[0].logprobs]
        assert ids == greedy[i % 8]
        assert len(lps) == len(ids)
        if i >= 8:
            continue  # the same prompts again: the same reference
        ref = hf_logprobs(model, prompt + ids)[len(prompt) - 1 : -1]
        for pos, (token, entry) in enumerate(zip(ids, lps)):
            top = ref[pos].topk(5)
            assert entry[token].rank == 1
            assert entry[token].logprob == pytest.approx(ref[pos, token].item(), abs=1e-4)
            for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
                assert entry[t].rank == rank and entry[t].logprob == pytest.approx(v, abs=1e-4)
        assert outs[-1].outputs[0].cumulative_logprob == pytest.approx(
            sum(ref[pos, t].item() for pos, t in enumerate(ids)), abs=1e-3)


def test_core_killed_under_a_loaded_loop_fails_every_stream_in_time(core):
    """kill -9 of the core while the frontend's loop is busy: every pending
    stream raises EngineDeadError within the heartbeat timeout plus a margin."""
    proc, address = core
    sp = SamplingParams(temperature=0, max_tokens=250, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def main():
        async with AsyncEngine.connect(address) as engine:
            gens = [engine.generate(p, sp) for p in PROMPTS]
            for g in gens:
                await g.__anext__()
            stop_hog = asyncio.Event()
            hog = asyncio.create_task(hog_loop(0.04, 0.05, stop_hog))
            os.kill(proc.pid, signal.SIGKILL)
            t0 = time.monotonic()
            waits = await seconds_until_dead(gens, t0, 15)
            stop_hog.set()
            await hog
            assert max(waits) < 5, waits
            with pytest.raises(EngineDeadError):
                await engine.generate([5, 6], sp).__anext__()

    asyncio.run(main())


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_a_slow_consumer_gets_merged_outputs(core, kind):
    """A consumer that takes 0.5 s per output gets a few outputs, each with
    everything since its last, never a backlog of stale ones."""
    _, address = core
    sp = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, output_kind=kind)

    async def main():
        async with AsyncEngine.connect(address) as engine:
            fast = await collect(engine.generate(PROMPTS[0], sp))
            slow = []
            async for out in engine.generate(PROMPTS[0], sp):
                slow.append(out)
                await asyncio.sleep(0.5)
            return fast, slow

    fast, slow = asyncio.run(main())
    assert len(slow) < 10 < len(fast)
    if kind == RequestOutputKind.DELTA:
        for outs in (fast, slow):
            assert sum((o.outputs[0].token_ids for o in outs), []) == sum((o.outputs[0].token_ids for o in fast), [])
        assert "".join(o.outputs[0].text for o in slow) == "".join(o.outputs[0].text for o in fast)
    else:
        assert slow[-1].outputs[0].token_ids == fast[-1].outputs[0].token_ids
        assert slow[-1].outputs[0].text == fast[-1].outputs[0].text
        assert all(len(a.outputs[0].token_ids) < len(b.outputs[0].token_ids) for a, b in zip(slow, slow[1:]))
    assert slow[-1].finished and not any(o.finished for o in slow[:-1])


def test_a_step_is_handled_in_chunks_that_yield_to_the_loop(tmp_path):
    """256 requests' outputs of one step: other coroutines run between chunks,
    and every request gets its token."""
    tok = build_tokenizer(tmp_path)
    engine = AsyncEngine.connect("ipc:///nowhere")
    text = TokenText(tok, len(tok))
    sp = SamplingParams(max_tokens=4, output_kind=RequestOutputKind.DELTA)
    states = [RequestState(str(i), None, [5], sp, tok, text, time.time()) for i in range(256)]
    engine._states = {s.request_id: s for s in states}
    ids = np.arange(10, 266).tolist()
    msg = StepOutputs(outputs=[EngineCoreOutput(request_id=str(i), new_token_ids=pack_ids([t]))
                               for i, t in enumerate(ids)])

    async def main():
        ticks = []

        async def ticker():
            while True:
                ticks.append(sum(len(s.samples[0].token_ids) for s in states))
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        await engine._on_outputs(msg, client=None)  # nothing to abort: the client is never used
        task.cancel()
        return ticks

    ticks = asyncio.run(main())
    assert [s.samples[0].token_ids for s in states] == [[t] for t in ids]
    assert len([t for t in ticks if 0 < t < 256]) >= 3  # the ticker ran while the step was half done
