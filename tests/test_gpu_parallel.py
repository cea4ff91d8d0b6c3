"""Tensor and data parallelism on two GPUs (skipped with fewer), against one GPU."""
from __future__ import annotations

import asyncio

import pytest
import torch

from headrace import LLM, AsyncEngine, RequestOutputKind, SamplingParams
from tests.conftest import ARCHS
from tests.test_generate import prompts_of_lengths

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

LENGTHS = [1, 7, 16, 33, 100, 250]


def generate(path, sp, prompts, **kwargs):
    with LLM(path, device="cuda", max_model_len=512, **kwargs) as llm:
        return llm.generate(prompts, sp, use_tqdm=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_float32_greedy_is_token_identical_to_tp1(arch, checkpoint):
    """With CUDA graphs and overlapped scheduling, as on one GPU."""
    path = checkpoint(arch)
    prompts = prompts_of_lengths(1000, LENGTHS, seed=23)
    sp = SamplingParams(temperature=0, max_tokens=32, logprobs=3)
    one = generate(path, sp, prompts, dtype="float32")
    two = generate(path, sp, prompts, dtype="float32", tensor_parallel_size=2)
    for a, b in zip(one, two):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for ra, rb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: e.logprob for t, e in rb.items()} == pytest.approx(
                {t: e.logprob for t, e in ra.items()}, abs=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_bfloat16_logprobs_within_tolerance_of_tp1(arch, checkpoint):
    """bf16 sums in another order over two ranks: the chosen tokens' logprobs,
    each scored on the same prefix (prompt logprobs), stay within 0.05."""
    path = checkpoint(arch)
    prompts = prompts_of_lengths(1000, LENGTHS[1:], seed=29)
    sp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    one = generate(path, sp, prompts, dtype="bfloat16")
    two = generate(path, sp, prompts, dtype="bfloat16", tensor_parallel_size=2)
    for prompt, a, b in zip(prompts, one, two):
        for t, ra, rb in zip(prompt[1:], a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert rb[t].logprob == pytest.approx(ra[t].logprob, abs=0.05)


def test_dp2_over_two_gpus_matches_one(checkpoint):
    path = checkpoint("qwen3")
    sp = SamplingParams(temperature=0, max_tokens=16, output_kind=RequestOutputKind.FINAL_ONLY)
    prompts = prompts_of_lengths(1000, LENGTHS, seed=31)
    one = generate(path, SamplingParams(temperature=0, max_tokens=16), prompts, dtype="float32")

    async def main():
        async with AsyncEngine.from_model(str(path), data_parallel_size=2, device="cuda", dtype="float32",
                                          max_model_len=512) as engine:
            outs = await asyncio.gather(*(anext(engine.generate(p, sp)) for p in prompts))
            return [o.outputs[0].token_ids for o in outs]

    assert asyncio.run(main()) == [o.outputs[0].token_ids for o in one]
