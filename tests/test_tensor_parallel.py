"""Tensor parallelism on the CPU: two worker processes over gloo against one
unsharded runner and transformers."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import pytest

from headrace import LLM, AsyncEngine, EngineDeadError, RequestOutputKind, SamplingParams
from headrace.checkpoint import ConfigError
from tests.conftest import hf_greedy, hf_logprobs

PROMPTS = ["The river is low today.", "今天天气很好，我们去河边散步吧。", [7, 8, 9, 10, 11] * 6, "def f(x):"]
# Each arch splits differently: llama 2 KV heads over 2 ranks with o/q/k/v bias, qwen2 one KV head
# replicated on both ranks with q/k/v bias, qwen3 tied embeddings and q/k norms; an odd vocabulary
# pads the last rank's embedding and LM-head rows.
CASES = {
    "llama": dict(attention_bias=True),
    "qwen2": dict(vocab_size=1001),
    "qwen3": dict(),
}


@pytest.mark.parametrize("arch", list(CASES))
def test_two_ranks_match_one_and_transformers(arch, checkpoint, hf_model):
    path = checkpoint(arch, **CASES[arch])
    sp = SamplingParams(temperature=0, max_tokens=16, logprobs=4, prompt_logprobs=2)
    engine = dict(max_model_len=256, block_size=8, device="cpu", dtype="float32", max_num_batched_tokens=32)
    with LLM(path, **engine) as llm:
        tok = llm.get_tokenizer()
        one = llm.generate(PROMPTS, sp, use_tqdm=False)
    with LLM(path, tensor_parallel_size=2, **engine) as llm:
        two = llm.generate(PROMPTS, sp, use_tqdm=False)
        assert llm.engine.executor.num_blocks == llm.engine.cache_config.num_blocks
    model = hf_model(path)
    for prompt, a, b in zip(PROMPTS, one, two):
        ids = prompt if isinstance(prompt, list) else tok.encode(prompt)
        ca, cb = a.outputs[0], b.outputs[0]
        assert cb.token_ids == ca.token_ids == hf_greedy(model, ids, 16)
        ref = hf_logprobs(model, ids + cb.token_ids)
        for i, (row_a, row_b) in enumerate(zip(ca.logprobs, cb.logprobs)):
            assert row_b.keys() == row_a.keys()
            for t in row_b:
                assert row_b[t].logprob == pytest.approx(row_a[t].logprob, abs=1e-5)
                assert row_b[t].logprob == pytest.approx(ref[len(ids) + i - 1, t].item(), abs=1e-4)
        for row_a, row_b in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert {t: e.logprob for t, e in row_b.items()} == pytest.approx({t: e.logprob for t, e in row_a.items()},
                                                                              abs=1e-5)


def test_seeded_sampling_and_preemption_match_one_rank(checkpoint):
    path = checkpoint("qwen3")
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=40, n=2, ignore_eos=True)
    # 10 blocks of 8 tokens: the four requests cannot all hold their blocks, so some are preempted
    engine = dict(max_model_len=80, block_size=8, num_kv_blocks=12, device="cpu", dtype="float32")
    with LLM(path, **engine) as llm:
        one = llm.generate(PROMPTS, sp, use_tqdm=False)
    with LLM(path, tensor_parallel_size=2, **engine) as llm:
        two = llm.generate(PROMPTS, sp, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
    assert [[c.token_ids for c in o.outputs] for o in two] == [[c.token_ids for c in o.outputs] for o in one]


def test_beam_search_on_two_ranks_matches_one(checkpoint):
    path = checkpoint("llama", **CASES["llama"])
    sp = SamplingParams(use_beam_search=True, best_of=3, n=2, temperature=0, max_tokens=12, logprobs=1)
    engine = dict(max_model_len=128, block_size=8, device="cpu", dtype="float32", max_num_batched_tokens=16)
    with LLM(path, **engine) as llm:
        one = llm.generate(PROMPTS, sp, use_tqdm=False)
    with LLM(path, tensor_parallel_size=2, **engine) as llm:
        two = llm.generate(PROMPTS, sp, use_tqdm=False)
    for a, b in zip(one, two):
        assert [c.token_ids for c in b.outputs] == [c.token_ids for c in a.outputs]
        for ca, cb in zip(a.outputs, b.outputs):
            assert cb.cumulative_logprob == pytest.approx(ca.cumulative_logprob, abs=1e-4)
            assert [list(e) for e in cb.logprobs] == [list(e) for e in ca.logprobs]


def test_shapes_the_ranks_cannot_split_are_refused(checkpoint):
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 does not divide the model's 4 attention heads"):
        LLM(checkpoint("qwen3"), tensor_parallel_size=3, device="cpu")
    with pytest.raises(ValueError, match="tensor_parallel_size must be"):
        LLM(checkpoint("qwen3"), tensor_parallel_size=0, device="cpu")


def _children(pid: int, pattern: str) -> list[int]:
    """The child processes of pid whose command line contains pattern."""
    out = subprocess.run(["pgrep", "-f", "-P", str(pid), pattern], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _workers_of(pid: int) -> list[int]:
    return _children(pid, "headrace.core.tp")


def test_a_dead_worker_fails_the_engine_fast_and_leaves_no_process(checkpoint):
    asyncio.run(dead_worker_fails_the_engine_fast(checkpoint("qwen3"), "cpu"))


async def dead_worker_fails_the_engine_fast(path, device: str) -> None:
    """SIGKILL rank 1 mid-stream: the stream fails within 5 s naming the rank, and the core and the
    other worker exit."""
    engine = AsyncEngine.from_model(str(path), tensor_parallel_size=2, max_model_len=1024,
                                    device=device, dtype="float32")
    async with engine:
        core = engine._process.proc.pid
        workers = _workers_of(core)
        assert len(workers) == 2
        sp = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        stream = engine.generate("The river", sp)
        await stream.__anext__()
        os.kill(workers[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="tensor-parallel worker rank 1"):
            async for _ in stream:
                pass
        assert time.monotonic() - start < 5
        for _ in range(100):  # the core exits, and takes its other worker with it
            if engine._process.proc.poll() is not None and not any(os.path.exists(f"/proc/{w}") for w in workers):
                break
            await asyncio.sleep(0.1)
        assert engine._process.proc.poll() is not None
        assert not [w for w in workers if os.path.exists(f"/proc/{w}")]
