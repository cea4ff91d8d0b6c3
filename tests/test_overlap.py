"""Overlapped scheduling against one-step-at-a-time on the same requests:
the tokens, logprobs and finish reasons must not depend on whether step N+1
was queued before step N was read back."""
from __future__ import annotations

import pytest
import torch

from headrace import LLM, SamplingParams
from tests.conftest import assert_blocks_free
from tests.test_generate import prompts_of_lengths

ENGINES = {
    "default": dict(max_model_len=256),
    "chunked": dict(max_model_len=256, max_num_batched_tokens=9, max_num_seqs=3),
    "preempting": dict(max_model_len=120, block_size=8, num_kv_blocks=16, max_num_batched_tokens=64),
}


def mixed_params(vocab: int) -> list[SamplingParams]:
    """One of each kind of row: greedy with logprobs, seeded samples with
    filters and penalties, min_tokens, a stop token, n > 1, chosen-id logprobs."""
    return [
        SamplingParams(temperature=0, max_tokens=20, logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=17, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, seed=3, max_tokens=12, min_tokens=10, stop_token_ids=[5, 6]),
        SamplingParams(temperature=1.1, seed=11, max_tokens=25, stop_token_ids=list(range(20, 84))),
        SamplingParams(temperature=0.7, seed=5, n=3, max_tokens=9, presence_penalty=0.5, logprobs=1),
        SamplingParams(temperature=0, max_tokens=14, logprob_token_ids=[1, 2, vocab - 1], act_func="sigmoid"),
    ]


def run(path, device: str, async_scheduling: bool, engine: dict, dtype="auto"):
    llm = LLM(path, device=device, dtype=dtype, async_scheduling=async_scheduling, **engine)
    vocab = llm.engine.model_config.vocab_size
    prompts = prompts_of_lengths(vocab, [5, 70, 13, 1, 40, 22], seed=41)
    outs = llm.generate(prompts, mixed_params(vocab), use_tqdm=False)
    assert_blocks_free(llm)
    return llm, outs


def assert_same(a, b, tol: float) -> None:
    for x, y in zip(a, b, strict=True):
        for cx, cy in zip(x.outputs, y.outputs, strict=True):
            assert cx.token_ids == cy.token_ids
            assert (cx.finish_reason, cx.stop_reason) == (cy.finish_reason, cy.stop_reason)
            assert cx.cumulative_logprob == pytest.approx(cy.cumulative_logprob, abs=tol * len(cx.token_ids))
            for ex, ey in zip(cx.logprobs or [], cy.logprobs or [], strict=True):
                assert set(ex) == set(ey)
                for tid in ex:
                    assert ex[tid].logprob == pytest.approx(ey[tid].logprob, abs=tol)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_overlap_gives_what_one_step_at_a_time_gives(engine, checkpoint):
    path = checkpoint("qwen3")
    llm, overlapped = run(path, "cpu", True, ENGINES[engine])
    _, stepped = run(path, "cpu", False, ENGINES[engine])
    assert_same(overlapped, stepped, tol=1e-4)
    if engine == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_overlap_on_cuda_gives_what_one_step_at_a_time_gives(checkpoint):
    path = checkpoint("llama")
    for engine in ENGINES.values():
        _, overlapped = run(path, "cuda", True, engine, dtype="float32")
        _, stepped = run(path, "cuda", False, engine, dtype="float32")
        assert_same(overlapped, stepped, tol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_queuing_a_step_never_waits_for_the_device(checkpoint):
    """execute() issues no synchronising CUDA call (torch's sync debug mode
    raises on one): prefill chunks, decode graphs, penalties, min_tokens,
    logprobs and prompt logprobs. collect() is where the host waits."""
    path = checkpoint("qwen3")
    llm = LLM(path, device="cuda", max_model_len=256, max_num_batched_tokens=48, max_num_seqs=8,
              enable_prefix_caching=False)  # the checked run computes its prompts again, in chunks
    vocab = llm.engine.model_config.vocab_size
    prompts = prompts_of_lengths(vocab, [5, 70, 13, 1, 40, 22], seed=42)
    params = mixed_params(vocab)
    params[0] = SamplingParams(temperature=0, max_tokens=20, logprobs=3, prompt_logprobs=2)
    llm.generate(prompts, params, use_tqdm=False)  # compiles and captures outside the check
    executor = llm.engine.executor
    execute = executor.execute
    calls = []

    def checked(sched):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return execute(sched)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            calls.append(sched.total_num_scheduled_tokens)

    executor.execute = checked
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(calls) > 10 and max(calls) >= 48 and min(calls) < 8  # prefill chunks and decode steps ran
    assert all(len(o.outputs) >= 1 and o.outputs[0].token_ids for o in outs)


def test_an_id_reused_while_its_old_step_is_in_flight_gets_only_its_own_tokens(checkpoint):
    """Abort a request while its step is queued, add a new request under the
    same id at once: reading back the old step must not touch the new one."""
    from headrace.config import EngineArgs
    from headrace.core.engine import EngineCore
    from headrace.core.protocol import unpack_ids

    path = checkpoint("qwen3")
    greedy = SamplingParams(temperature=0, max_tokens=6)

    def run(core):
        tokens = []
        while core.has_unfinished:
            for out in core.step():
                tokens += unpack_ids(out.new_token_ids).tolist()
        return tokens

    want = run(_add(EngineCore(EngineArgs(model=path, max_model_len=64)), "r", [9, 8, 7], greedy))
    core = _add(EngineCore(EngineArgs(model=path, max_model_len=64)), "r", [5, 6, 7, 8], greedy)
    core.step()
    core.step()  # the old request's second step is queued, its first read back
    assert core.abort(["r"]) == ["r"]
    assert core.has_unfinished and not core.scheduler.requests  # only the queued step is left
    _add(core, "r", [9, 8, 7], greedy)
    assert run(core) == want
    assert core.scheduler.kv.num_free_blocks == core.cache_config.num_blocks


def _add(core, rid, prompt, params):
    core.add_request(rid, prompt, params, 0.0)
    return core
