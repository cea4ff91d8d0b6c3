"""Shutting an engine down frees what its executor held, in this process or in a spawned core."""
from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import weakref

import pytest

from headrace import LLM, AsyncEngine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def test_llm_shutdown_frees_the_executor_and_a_second_llm_runs(checkpoint):
    path = checkpoint("qwen3")
    llm = LLM(path, max_model_len=128)
    first = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine, runner = llm.engine, llm.engine.executor
    num_blocks = engine.cache_config.num_blocks
    held = [weakref.ref(t) for t in (runner.kv_caches[0], next(runner.model.parameters()),
                                     runner.states.token_ids.gpu, runner.states.sampling.temperature.gpu)]
    llm.shutdown()
    # Gone while the test still holds the LLM, its engine and its runner.
    assert [ref() for ref in held] == [None] * len(held)
    assert runner.closed and runner.model is None and runner.graphs is None and not runner.kv_caches
    for call in (engine.step, lambda: engine.add_request("late", [5, 6], GREEDY, 0.0), lambda: engine.abort(["x"]),
                 lambda: runner.remove(["x"])):
        with pytest.raises(RuntimeError, match="the engine has been shut down"):
            call()
    engine.close()  # closing again, or shutting down again, is harmless
    llm.shutdown()
    with pytest.raises(RuntimeError, match="this LLM has been shut down"):  # not a hang
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)

    again = LLM(path, max_model_len=128)
    assert again.engine.cache_config.num_blocks == num_blocks
    assert again.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first


def test_aclose_returns_once_the_spawned_core_has_exited(checkpoint):
    """A spawned core's memory is freed when its process exits: aclose() waits for that."""

    async def main():
        engine = AsyncEngine.from_model(checkpoint("qwen3"), max_model_len=64)
        async with engine:
            outs = [o async for o in engine.generate([5, 6, 7], GREEDY)]
            assert len(outs[-1].outputs[0].token_ids) == 8
        return engine._process.proc

    proc = asyncio.run(main())
    assert proc.returncode == 0  # exited by itself on SIGTERM (closing its engine), not killed


def test_freeze_heap_frees_garbage_cycles_before_it_freezes():
    """A spawned core (and a tensor-parallel worker) freezes its heap once its engine is built; what is
    garbage by then, such as an object in a reference cycle, is freed first, not frozen for good. Run in a
    process of its own: freezing this one would change every later test's collections."""
    code = ("import gc, weakref\n"
            "from headrace.lifetime import freeze_heap\n"
            "class Node: pass\n"
            "node = Node(); node.me = node; ref = weakref.ref(node); del node\n"
            "freeze_heap()\n"
            "print(ref() is None, gc.get_freeze_count() > 1000)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "True"], out.stderr


def test_generate_freezes_the_heap_only_while_it_runs(checkpoint, monkeypatch):
    """LLM.generate freezes what is alive for its length (lifetime.heap_frozen), so full collections skip
    torch and the model meanwhile, and unfreezes it all when it returns. It freezes even where objects
    are frozen already (an interpreter may freeze some at startup), and then unfreezes those too."""
    llm = LLM(checkpoint("qwen3"), max_model_len=64)
    seen = []
    call = llm._call
    monkeypatch.setattr(llm, "_call", lambda coro: seen.append(gc.get_freeze_count()) or call(coro))
    try:
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
        assert seen[-1] > 1000 and gc.get_freeze_count() == 0
        gc.freeze()  # frozen before the call
        before = gc.get_freeze_count()
        made_since = [[i] for i in range(5000)]  # alive, not frozen yet
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
        assert seen[-1] >= before + len(made_since) and gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
        llm.shutdown()
