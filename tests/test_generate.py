"""The offline engine against transformers on the same checkpoints."""
from __future__ import annotations

import random

import pytest
import torch

from headrace import LLM, SamplingParams
from headrace.testing.checkpoint import copy_with_eos
from tests.conftest import ARCHS, assert_blocks_free, hf_greedy, hf_logprobs

MAX_TOKENS = 12


def prompts_of_lengths(vocab: int, lengths, seed=0, prefix=()) -> list[list[int]]:
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(5, vocab) for _ in range(n)] for n in lengths]


def check_greedy(llm: LLM, model, prompts, max_tokens=MAX_TOKENS):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    for prompt, out in zip(prompts, outs):
        ref = hf_greedy(model, prompt, max_tokens)
        got = out.outputs[0]
        assert got.token_ids == ref, f"prompt of {len(prompt)} tokens diverged"
        # transformers stops at EOS too; otherwise the request ran to max_tokens.
        assert got.finish_reason == ("length" if len(ref) == max_tokens and ref[-1] != 1 else "stop")
    assert_blocks_free(llm)
    return outs


LENGTHS = [1, 3, 17, 64, 150, 33, 250]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, checkpoint, hf_model):
    path = checkpoint(arch)
    llm = LLM(path, max_model_len=512)
    check_greedy(llm, hf_model(path), prompts_of_lengths(llm.engine.model_config.vocab_size, LENGTHS))


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches_transformers(arch, checkpoint, hf_model):
    path = checkpoint(arch)
    llm = LLM(path, max_model_len=512, max_num_batched_tokens=7, max_num_seqs=3)
    check_greedy(llm, hf_model(path), prompts_of_lengths(llm.engine.model_config.vocab_size, LENGTHS, seed=1))


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_matches_transformers(arch, checkpoint, hf_model):
    path = checkpoint(arch)
    # 20 blocks of 8 tokens: one 160-token sequence fits, six long ones do not.
    llm = LLM(path, max_model_len=160, block_size=8, num_kv_blocks=20, max_num_batched_tokens=64)
    prompts = prompts_of_lengths(llm.engine.model_config.vocab_size, [40, 45, 50, 30, 60, 35], seed=2)
    check_greedy(llm, hf_model(path), prompts, max_tokens=24)
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_caching_matches_transformers(arch, checkpoint, hf_model):
    path = checkpoint(arch)
    llm = LLM(path, max_model_len=512, block_size=8)
    vocab = llm.engine.model_config.vocab_size
    shared = prompts_of_lengths(vocab, [70], seed=3)[0]
    prompts = prompts_of_lengths(vocab, [5, 20, 1, 37], seed=4, prefix=shared) + [shared[:64], shared]
    kv = llm.engine.scheduler.kv
    first = check_greedy(llm, hf_model(path), prompts[:1])
    hits = kv.num_hits
    second = check_greedy(llm, hf_model(path), prompts)
    assert kv.num_hits - hits >= 8 * (70 // 8) * 3  # later prompts reuse the shared full blocks
    assert first[0].outputs[0].token_ids == second[0].outputs[0].token_ids


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_match_transformers(arch, checkpoint, hf_model):
    path = checkpoint(arch)
    model = hf_model(path)
    llm = LLM(path, max_model_len=256)
    prompts = prompts_of_lengths(llm.engine.model_config.vocab_size, [4, 40, 9], seed=5)
    params = [SamplingParams(temperature=0, max_tokens=6, logprobs=5),
              SamplingParams(temperature=0.8, seed=11, max_tokens=6, logprobs=0),
              SamplingParams(temperature=0, max_tokens=6)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, sp, out in zip(prompts, params, outs):
        got = out.outputs[0]
        if sp.logprobs is None:
            assert got.logprobs is None and got.cumulative_logprob is None
            continue
        ref = hf_logprobs(model, prompt + got.token_ids)[len(prompt) - 1 : -1]  # [generated, vocab]
        assert len(got.logprobs) == len(got.token_ids)
        total = 0.0
        for pos, (token, entry) in enumerate(zip(got.token_ids, got.logprobs)):
            row = ref[pos]
            top = row.topk(sp.logprobs)
            expected = dict(zip(top.indices.tolist(), top.values.tolist()))
            expected[token] = row[token].item()
            assert set(entry) == set(expected)
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(expected[tid], abs=1e-4)
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            ranks = sorted(lp.rank for tid, lp in entry.items() if tid in top.indices.tolist())
            assert ranks == list(range(1, sp.logprobs + 1))
            assert all(isinstance(lp.decoded_token, str) for lp in entry.values())
            total += row[token].item()
        assert got.cumulative_logprob == pytest.approx(total, abs=1e-3)
    assert_blocks_free(llm)


def test_rope_scaling_matches_transformers(checkpoint, hf_model):
    for scaling in ({"rope_type": "linear", "factor": 2.0},
                    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 64}):
        path = checkpoint("llama", rope_scaling=scaling, rope_theta=500.0)
        llm = LLM(path, max_model_len=400)
        check_greedy(llm, hf_model(path), prompts_of_lengths(llm.engine.model_config.vocab_size, [3, 300], seed=6))


def test_sharded_checkpoint_with_bias(checkpoint, hf_model):
    path = checkpoint("llama", max_shard_size="60KB", attention_bias=True)
    assert len(list(path.glob("*.safetensors"))) > 1
    llm = LLM(path, max_model_len=128)
    check_greedy(llm, hf_model(path), prompts_of_lengths(llm.engine.model_config.vocab_size, [5, 50], seed=7))


def test_seeded_sampling_is_independent_of_the_batch(checkpoint):
    llm = LLM(checkpoint("qwen3"), max_model_len=256, block_size=8)
    vocab = llm.engine.model_config.vocab_size
    target = prompts_of_lengths(vocab, [12], seed=8)[0]
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, min_p=0.01, seed=1234, max_tokens=20)
    alone = llm.generate([target], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = prompts_of_lengths(vocab, [3, 90, 40, 7], seed=9)
    mixed = [SamplingParams(temperature=t, seed=s, max_tokens=m)
             for t, s, m in [(0, None, 5), (1.3, 7, 30), (0.5, None, 2), (1.0, 99, 20)]]
    batch1 = llm.generate(others[:2] + [target] + others[2:], mixed[:2] + [sp] + mixed[2:], use_tqdm=False)
    batch2 = llm.generate([target] + others[::-1], [sp] + mixed[::-1], use_tqdm=False)
    assert batch1[2].outputs[0].token_ids == alone
    assert batch2[0].outputs[0].token_ids == alone
    other_seed = llm.generate([target], SamplingParams(temperature=0.9, seed=4321, max_tokens=20), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone
    assert_blocks_free(llm)


def test_unseeded_requests_follow_the_engine_seed(checkpoint):
    path = checkpoint("qwen3")
    prompts = [[7, 8, 9, 10]] * 3
    sp = SamplingParams(temperature=1.0, max_tokens=10)
    runs = [[o.outputs[0].token_ids for o in LLM(path, max_model_len=64, seed=s).generate(prompts, sp, use_tqdm=False)]
            for s in (5, 5, 6)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert len({tuple(t) for t in runs[0]}) > 1  # each request draws its own seed


def test_finish_conditions(checkpoint, hf_model):
    path = checkpoint("llama")
    llm = LLM(path, max_model_len=40)
    prompt = prompts_of_lengths(llm.engine.model_config.vocab_size, [10], seed=10)[0]
    ref = hf_greedy(hf_model(path), prompt, 8)
    stop_tok = ref[3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[: ref.index(stop_tok) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_tok)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(prompt) + len(out.token_ids) == 40 and out.finish_reason == "length"


def test_eos_stops_unless_ignored(checkpoint, hf_model, tmp_path):
    src = checkpoint("qwen2")
    prompt = [11, 12, 13, 14, 15]
    ref = hf_greedy(hf_model(src), prompt, 10)
    eos = ref[4]
    path = copy_with_eos(src, tmp_path / "eos", eos)  # EOS is a token the model will emit greedily
    llm = LLM(path, max_model_len=64)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[: ref.index(eos) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref and out.finish_reason == "length"
    assert_blocks_free(llm)


def test_outputs_and_metrics(checkpoint):
    llm = LLM(checkpoint("qwen3"), max_model_len=128)
    outs = llm.generate(["Hello there", "今天天气很好"], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    tok = llm.get_tokenizer()
    for prompt, out in zip(["Hello there", "今天天气很好"], outs):
        assert out.prompt == prompt and out.prompt_token_ids == tok.encode(prompt)
        assert out.finished and out.outputs[0].index == 0
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert [o.request_id for o in outs] == sorted({o.request_id for o in outs}, key=int)


def test_bfloat16_runs_close_to_float32(checkpoint):
    path = checkpoint("qwen3")
    prompts = [[5, 6, 7, 8, 9] * 4]
    sp = SamplingParams(temperature=0, max_tokens=1, logprobs=3)
    lp32 = LLM(path, max_model_len=64).generate(prompts, sp, use_tqdm=False)[0].outputs[0].logprobs[0]
    llm16 = LLM(path, max_model_len=64, dtype="bfloat16")
    assert llm16.engine.executor.dtype == torch.bfloat16
    lp16 = llm16.generate(prompts, sp, use_tqdm=False)[0].outputs[0].logprobs[0]
    common = set(lp32) & set(lp16)
    assert common
    for tid in common:
        assert lp16[tid].logprob == pytest.approx(lp32[tid].logprob, abs=0.1)


def test_auto_dtype_follows_the_checkpoint(checkpoint):
    path = checkpoint("qwen3", dtype=torch.bfloat16)
    llm = LLM(path, max_model_len=64)
    assert llm.engine.executor.dtype == torch.bfloat16
    assert llm.engine.executor.kv_caches[0].dtype == torch.bfloat16
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, logprobs=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert LLM(path, max_model_len=64, dtype="float32").engine.executor.dtype == torch.float32
