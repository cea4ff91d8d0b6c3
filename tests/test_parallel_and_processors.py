"""n > 1, custom logits processors."""
from __future__ import annotations

import asyncio

import pytest

from headrace import LLM, AsyncEngine, SamplingParams
from tests.logits_plugins import ForceEveryK, NoRepeat


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("qwen3")


def test_n_samples_are_distinct_reproducible_and_batch_independent(path):
    with LLM(path, max_model_len=128, block_size=8) as llm:
        prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
        sp = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12)
        alone = llm.generate([prompt], sp, use_tqdm=False)[0]
        assert [c.index for c in alone.outputs] == [0, 1, 2, 3]
        samples = [tuple(c.token_ids) for c in alone.outputs]
        assert len(set(samples)) == 4
        others = [[5, 6, 7] * 7, [9, 8]]
        mixed = llm.generate(others[:1] + [prompt] + others[1:],
                             [SamplingParams(max_tokens=20), sp, SamplingParams(n=3, max_tokens=5)],
                             use_tqdm=False)
        assert [tuple(c.token_ids) for c in mixed[1].outputs] == samples
        assert len(mixed[2].outputs) == 3
        # Sample 0 is the same request as n=1 with that seed.
        single = llm.generate([prompt], SamplingParams(temperature=1.0, seed=7, max_tokens=12), use_tqdm=False)
        assert tuple(single[0].outputs[0].token_ids) == samples[0]


def test_n_samples_share_the_prompt_blocks(path):
    with LLM(path, max_model_len=128, block_size=8) as llm:
        kv = llm.engine.scheduler.kv
        prompt = list(range(20, 60))  # 40 tokens: 4 full blocks below the last token
        hits = kv.num_hits
        llm.generate([prompt], SamplingParams(n=5, temperature=0.8, max_tokens=4), use_tqdm=False)
        assert kv.num_hits - hits == 4 * 8 * 4  # each of the 4 siblings reuses the first one's 4 blocks


def test_n_with_stop_strings_and_streaming(path):
    async def main():
        async with AsyncEngine.from_model(path, max_model_len=128) as engine:
            base = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=30, ignore_eos=True)
            finals = [o async for o in engine.generate([5, 6, 7], base)][-1]
            text0 = finals.outputs[0].text
            stop = text0[10:13]
            sp = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=30, ignore_eos=True, stop=[stop])
            last = [o async for o in engine.generate([5, 6, 7], sp)][-1]
            assert last.finished and last.outputs[0].text == text0[: text0.index(stop)]
            assert last.outputs[0].stop_reason == stop
            for full, cut in zip(finals.outputs[1:], last.outputs[1:]):
                expected = full.text[: full.text.index(stop)] if stop in full.text else full.text
                assert cut.text == expected
            s = await engine.stats()
            assert s.num_running == 0 and s.num_free_blocks == s.num_blocks

    asyncio.run(main())


def test_custom_logits_processor_touches_only_its_requests(path):
    with LLM(path, max_model_len=128, logits_processors=[ForceEveryK, NoRepeat]) as llm:
        prompt = [11, 12, 13]
        plain = SamplingParams(temperature=0, max_tokens=12)
        forced = SamplingParams(temperature=0, max_tokens=12, extra_args={"force_every": 3, "force_token": 42})
        norep = SamplingParams(temperature=0, max_tokens=12, extra_args={"no_repeat": True})
        outs = llm.generate([prompt] * 3, [plain, forced, norep], use_tqdm=False)
        base, got, nr = (o.outputs[0].token_ids for o in outs)
        assert [got[i] for i in (2, 5, 8, 11)] == [42] * 4
        assert got[:2] == base[:2] and got != base
        assert all(a != b for a, b in zip(nr, nr[1:]))
    with LLM(path, max_model_len=128) as llm:  # the same requests on an engine without processors
        assert llm.generate([prompt], plain, use_tqdm=False)[0].outputs[0].token_ids == base


def test_spawned_core_imports_processors_by_name(path):
    async def main():
        engine = AsyncEngine.from_model(path, max_model_len=64, logits_processors=["tests.logits_plugins:ForceEveryK"])
        async with engine:
            sp = SamplingParams(temperature=0, max_tokens=6, extra_args={"force_every": 2, "force_token": 9})
            out = [o async for o in engine.generate([5, 6], sp)][-1]
            assert out.outputs[0].token_ids[1::2] == [9, 9, 9]

    asyncio.run(main())
    with pytest.raises(ValueError, match="'module:Class' strings"):
        AsyncEngine.from_model(path, logits_processors=[ForceEveryK])
    with pytest.raises(ValueError, match="not a LogitsProcessor"):
        LLM(path, max_model_len=64, logits_processors=["tests.logits_plugins:_ban_last"])
