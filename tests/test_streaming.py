"""Frontends and an engine core in real processes, over ZeroMQ."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from headrace import LLM, AsyncEngine, EngineDeadError, RequestOutputKind, SamplingParams
from headrace.core.protocol import AddRequest, Hello, PROTOCOL_VERSION, encode, pack_ids
from headrace.testing.checkpoint import make_scripted_checkpoint
from tests.conftest import hf_greedy
from tests.cores import seconds_until_dead, start_core, stop, wait_until_idle

WORKER = str(Path(__file__).with_name("frontend_worker.py"))
PROMPTS_A = ["The river is low today.", "今天天气很好，我们去河边散步吧。", [7, 8, 9, 10, 11] * 9]
PROMPTS_B = ["東京から大阪まで", "Emoji 👍🏽 and family 👨‍👩‍👧", "def f(x):\n    return x"]


@pytest.fixture
def core(checkpoint, tmp_path):
    proc, address = start_core(checkpoint("qwen3"), f"ipc://{tmp_path}/core.sock")
    yield proc, address
    stop(proc)


def test_two_frontend_processes_stream_their_own_requests(core, checkpoint, hf_model):
    proc, address = core
    workers = [subprocess.Popen([sys.executable, WORKER, "stream", address, json.dumps(p)], stdout=subprocess.PIPE,
                                text=True) for p in (PROMPTS_A, PROMPTS_B)]
    results = [json.loads(w.communicate(timeout=120)[0]) for w in workers]
    path = checkpoint("qwen3")
    model = hf_model(path)
    with LLM(path, max_model_len=256, block_size=8) as llm:
        tok = llm.get_tokenizer()
        for prompts, got in zip((PROMPTS_A, PROMPTS_B), results):
            offline = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
            for prompt, res, off in zip(prompts, got, offline):
                ids = prompt if isinstance(prompt, list) else tok.encode(prompt)
                assert res["token_ids"] == off.outputs[0].token_ids == hf_greedy(model, ids, 24)
                text = "".join(res["deltas"])
                assert text == off.outputs[0].text == tok.decode(res["token_ids"], skip_special_tokens=True)
                if "\ufffd" not in text:  # a random model may emit invalid UTF-8 itself
                    assert all("\ufffd" not in d for d in res["deltas"])


def run(coro):
    return asyncio.run(coro)


def test_output_kinds_stop_strings_and_utf8(core):
    _, address = core

    async def main():
        async with AsyncEngine.connect(address) as engine:
            prompt = "今天天气很好，👍🏽"
            base = SamplingParams(temperature=0.8, seed=5, max_tokens=40, ignore_eos=True)
            kinds = {}
            for kind in RequestOutputKind:
                sp = msgspec.structs.replace(base, output_kind=kind)
                kinds[kind] = [o async for o in engine.generate(prompt, sp)]
            final = kinds[RequestOutputKind.FINAL_ONLY]
            assert len(final) == 1 and final[0].finished
            text, ids = final[0].outputs[0].text, final[0].outputs[0].token_ids
            deltas = kinds[RequestOutputKind.DELTA]
            assert "".join(o.outputs[0].text for o in deltas) == text
            assert sum((o.outputs[0].token_ids for o in deltas), []) == ids
            if "\ufffd" not in text:
                assert all("\ufffd" not in o.outputs[0].text for o in deltas)
            cumulative = kinds[RequestOutputKind.CUMULATIVE]
            assert cumulative[-1].outputs[0].text == text and cumulative[-1].outputs[0].token_ids == ids
            assert all(a.outputs[0].text == b.outputs[0].text[: len(a.outputs[0].text)]
                       for a, b in zip(cumulative, cumulative[1:]))
            assert text == engine.tokenizer.decode(ids, skip_special_tokens=True)

            # A stop string taken from the middle of that text cuts it there.
            stop_str = text[len(text) // 2 : len(text) // 2 + 3]
            cut = text.index(stop_str)
            for include in (False, True):
                sp = msgspec.structs.replace(base, stop=[stop_str], include_stop_str_in_output=include,
                                             output_kind=RequestOutputKind.DELTA)
                outs = [o async for o in engine.generate(prompt, sp)]
                got = "".join(o.outputs[0].text for o in outs)
                assert got == text[: cut + (len(stop_str) if include else 0)]
                assert (outs[-1].outputs[0].finish_reason, outs[-1].outputs[0].stop_reason) == ("stop", stop_str)
            await wait_until_idle(engine)  # the core aborted the stopped requests

    run(main())


def test_bad_input_is_refused_and_disturbs_nothing(core):
    _, address = core

    async def main():
        async with AsyncEngine.connect(address) as engine:
            sp = SamplingParams(temperature=0, max_tokens=8)
            expected = [o async for o in engine.generate([5, 6, 7], sp)][-1].outputs[0].token_ids
            long_run = engine.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                                       request_id="keep")
            first = await long_run.__anext__()
            with pytest.raises(ValueError, match="already in use"):
                await engine.generate([1, 2], sp, request_id="keep").__anext__()
            with pytest.raises(ValueError, match="max_model_len is 256"):
                await engine.generate([5] * 300, sp).__anext__()
            with pytest.raises(ValueError, match="outside the vocabulary"):
                await engine.generate([5, 10**6], sp).__anext__()
            with pytest.raises(KeyError, match="unknown request ids"):
                await engine.abort("no-such-request")
            with pytest.raises(ValueError, match="temperature"):
                SamplingParams(temperature=-1)
            # A prompt the frontend would refuse, sent straight to the core, is refused there.
            state = await engine.submit(None, [5] * 300, sp, request_id="raw")
            with pytest.raises(ValueError, match="max_model_len is 256"):
                await engine.outputs(state).__anext__()
            assert not engine.is_running("raw")
            rest = [o async for o in long_run]
            final = rest[-1].outputs[0].token_ids
            assert final[: len(first.outputs[0].token_ids)] == first.outputs[0].token_ids  # cumulative
            assert final[: len(expected)] == expected  # greedy: untouched by the refused requests
            assert len(final) == 60
            again = [o async for o in engine.generate([5, 6, 7], sp)][-1].outputs[0].token_ids
            assert again == expected
            await wait_until_idle(engine)

    run(main())


def test_cancelling_a_consumer_or_aborting_frees_the_request(core):
    _, address = core

    async def main():
        async with AsyncEngine.connect(address) as engine:
            sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            started = asyncio.Event()

            async def consume():
                async for _ in engine.generate([5, 6, 7, 8], sp):
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            s = await wait_until_idle(engine, timeout=5)
            assert s.num_running == 0
            gen = engine.generate([5, 6, 7, 8], sp, request_id="x")
            await gen.__anext__()
            await engine.abort("x")
            outs = [o async for o in gen]
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
            await wait_until_idle(engine, timeout=5)

    run(main())


def test_core_killed_every_frontend_raises_engine_dead(core):
    proc, address = core

    async def main():
        engines = [AsyncEngine.connect(address) for _ in range(2)]
        for e in engines:
            await e.start()
        sp = SamplingParams(temperature=0, max_tokens=250, ignore_eos=True)
        gens = [e.generate([5, 6, 7], sp) for e in engines]
        for g in gens:
            await g.__anext__()
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        waits = await seconds_until_dead(gens, t0, 10)
        # an ipc core runs on this machine: its exit is seen at once, not after the 3 s heartbeat timeout
        assert max(waits) < 0.5, waits
        for e in engines:
            with pytest.raises(EngineDeadError):
                await e.generate([5, 6], sp).__anext__()
            await e.aclose()

    run(main())


def test_spawned_core_dies_with_its_frontend_and_reports_death(checkpoint):
    parent = subprocess.Popen([sys.executable, WORKER, "spawn", str(checkpoint("qwen3"))], stdout=subprocess.PIPE,
                              text=True)
    core_pid = int(parent.stdout.readline())
    os.kill(core_pid, 0)  # alive
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(core_pid):
        assert time.monotonic() < deadline, "the core outlived its parent"
        time.sleep(0.1)

    async def main():  # a spawned core that is killed is seen dead at once
        engine = AsyncEngine.from_model(checkpoint("qwen3"), max_model_len=64)
        await engine.start()
        gen = engine.generate([5, 6, 7], SamplingParams(max_tokens=60, ignore_eos=True))
        await gen.__anext__()
        engine._process.proc.kill()
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        assert time.monotonic() - t0 < 0.5
        await engine.aclose()

    run(main())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by init) counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_frontend_killed_midstream_core_aborts_its_requests(checkpoint, tmp_path):
    # One request at a time: the worker's 64 x 200 tokens take far longer than
    # the wait below, so an idle core means they were aborted.
    proc, address = start_core(checkpoint("qwen3"), f"ipc://{tmp_path}/core.sock", "--max-num-seqs", "1")
    worker = subprocess.Popen([sys.executable, WORKER, "hang", address], stdout=subprocess.PIPE, text=True)
    assert worker.stdout.readline().strip() == "streaming"

    async def main():
        async with AsyncEngine.connect(address) as engine:
            s = await engine.stats()
            assert s.num_running + s.num_waiting == 64 and s.num_frontends == 2
            worker.kill()
            worker.wait()
            t0 = time.monotonic()
            s = await wait_until_idle(engine, timeout=8)
            assert s.num_frontends == 1
            # the core watches an ipc frontend's process: it is dropped at its exit, not 3 s of silence later
            assert time.monotonic() - t0 < 1.5

    try:
        run(main())
    finally:
        worker.kill()
        stop(proc)


def test_fuzzed_frames_do_not_disturb_the_core(core):
    proc, address = core
    rng = random.Random(0)
    ctx = zmq.Context()
    valid = encode(AddRequest(request_id="f", prompt_token_ids=pack_ids([5, 6, 7]),
                              sampling_params=SamplingParams(max_tokens=2), arrival_time=0.0))
    hello = encode(Hello(protocol=PROTOCOL_VERSION, pid=0))
    try:
        for said_hello in (False, True):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            if said_hello:
                sock.send(hello)
            for i in range(400):
                kind = i % 4
                if kind == 0:
                    frames = [rng.randbytes(rng.randrange(0, 64))]
                elif kind == 1:
                    frames = [valid[: rng.randrange(len(valid))]]
                elif kind == 2:
                    mutated = bytearray(valid)
                    for _ in range(3):
                        mutated[rng.randrange(len(mutated))] = rng.randrange(256)
                    frames = [bytes(mutated)]
                else:
                    frames = [rng.randbytes(8) for _ in range(rng.randrange(2, 5))]
                sock.send_multipart(frames)
            sock.close()
        # A hostile but well-formed message: a huge max_tokens and a bogus prompt.
        evil = ctx.socket(zmq.DEALER)
        evil.connect(address)
        evil.send(hello)
        evil.send(encode(AddRequest(request_id="e", prompt_token_ids=b"\x01\x02\x03",
                                    sampling_params=SamplingParams(), arrival_time=0.0)))
        evil.close(linger=100)
    finally:
        ctx.term()
    assert proc.poll() is None

    async def main():
        async with AsyncEngine.connect(address) as engine:
            outs = [o async for o in engine.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=5))]
            assert len(outs[-1].outputs[0].token_ids) == 5
            await wait_until_idle(engine)

    run(main())


def test_ipc_socket_is_owner_only_and_tcp_defaults_to_loopback(core, checkpoint):
    _, address = core
    mode = stat.S_IMODE(os.stat(address[len("ipc://"):]).st_mode)
    assert mode == 0o600
    proc, tcp = start_core(checkpoint("qwen3"), "tcp://127.0.0.1:0")
    try:
        assert tcp.startswith("tcp://127.0.0.1:") and not tcp.endswith(":0")

        async def main():
            async with AsyncEngine.connect(tcp) as engine:
                chat = [{"role": "user", "content": "你好"}]
                outs = [o async for o in engine.generate(chat, SamplingParams(max_tokens=3))]
                assert outs[-1].prompt == engine.tokenizer.apply_chat_template(chat, tokenize=False,
                                                                                 add_generation_prompt=True)
                assert outs[-1].prompt_token_ids == engine.tokenizer.encode(outs[-1].prompt,
                                                                             add_special_tokens=False)

        run(main())
    finally:
        stop(proc)


def test_split_characters_stream_whole(tmp_path, hf_model):
    """A scripted model spells CJK and emoji text whose characters are split
    across byte-level tokens: no delta shows a broken character, and the
    deltas add up to the text."""
    texts = ["A河边散步吧。", "B👨‍👩‍👧家族", "C東京🇯🇵大阪"]
    path, prompts = make_scripted_checkpoint(tmp_path / "scripted", texts)

    async def main():
        async with AsyncEngine.from_model(path, max_model_len=64) as engine:
            tok = engine.tokenizer
            assert any(tok.decode([t]) == "\ufffd" for t in tok.encode("".join(texts)))  # really split
            sp = SamplingParams(temperature=0, max_tokens=30, output_kind=RequestOutputKind.DELTA)
            streams = await asyncio.gather(*(_collect(engine.generate(p, sp)) for p in prompts))
        for text, prompt, outs in zip(texts, prompts, streams):
            deltas = [o.outputs[0].text for o in outs]
            assert all("\ufffd" not in d for d in deltas)
            assert "".join(deltas) == text[1:]
            ids = sum((o.outputs[0].token_ids for o in outs), [])
            assert ids == hf_greedy(hf_model(path), prompt, 30)
            assert outs[-1].outputs[0].finish_reason == "stop"
            assert len(deltas) > 2

    run(main())


async def _collect(gen):
    return [o async for o in gen]
