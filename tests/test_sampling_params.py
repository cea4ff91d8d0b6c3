"""The SamplingParams surface against transformers on the same checkpoint."""
from __future__ import annotations

import pytest
import torch

from headrace import LLM, SamplingParams
from headrace.testing.checkpoint import copy_with_eos
from tests.conftest import hf_logprobs

PROMPTS = [[11, 12, 13, 14, 15], [40, 41] * 10, [7]]


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("llama")


@pytest.fixture(scope="module")
def llm(path):
    engine = LLM(path, max_model_len=128)
    yield engine
    engine.shutdown()


def hf_generate(model, prompt, max_new_tokens, **kwargs) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


def ours(llm, prompt, **kwargs):
    sp = SamplingParams(temperature=0, max_tokens=kwargs.pop("max_tokens", 16), **kwargs)
    return llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_matches_transformers(llm, path, hf_model, penalty):
    for prompt in PROMPTS:
        got = ours(llm, prompt, repetition_penalty=penalty).token_ids
        assert got == hf_generate(hf_model(path), prompt, 16, repetition_penalty=penalty)


def test_logit_bias_and_allowed_tokens_match_transformers(llm, path, hf_model):
    model = hf_model(path)
    for prompt in PROMPTS:
        base = ours(llm, prompt).token_ids
        bias = {base[0]: -100.0, 77: 8.0, 300: 3.5}
        got = ours(llm, prompt, logit_bias=bias).token_ids
        ref = hf_generate(model, prompt, 16, sequence_bias={(k,): v for k, v in bias.items()})
        assert got == ref and got != base
        allowed = [5, 77, 300, 301, 999, base[1]]
        got = ours(llm, prompt, allowed_token_ids=allowed).token_ids
        vocab = llm.engine.model_config.vocab_size
        ref = hf_generate(model, prompt, 16, suppress_tokens=[t for t in range(vocab) if t not in allowed])
        assert got == ref and set(got) <= set(allowed)


def test_bad_words_match_transformers(llm, path, hf_model):
    model = hf_model(path)
    prompt = PROMPTS[0]
    base = ours(llm, prompt).token_ids
    bad = [[base[2]], [base[4], base[5]], [123, 456]]  # a token, a pair the model would say, a pair it would not
    sp = SamplingParams(temperature=0, max_tokens=16, bad_words_token_ids=bad)
    got = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    ref = hf_generate(model, prompt, 16, bad_words_ids=bad)
    assert got == ref and base[2] not in got
    # bad_words as text goes through the tokenizer, with and without a leading space
    tok = llm.get_tokenizer()
    word = tok.decode(base[:2])
    got = ours(llm, prompt, bad_words=[word]).token_ids
    seqs = [tok.encode(word), tok.encode(" " + word)]
    assert got == hf_generate(model, prompt, 16, bad_words_ids=[s for s in seqs if s])


def test_min_tokens_masks_eos_and_stop_tokens(path, hf_model, tmp_path):
    model = hf_model(path)
    prompt = PROMPTS[0]
    ref = hf_generate(model, prompt, 12)
    eos = ref[2]
    eos_path = copy_with_eos(path, tmp_path / "eos", eos)
    with LLM(eos_path, max_model_len=64) as llm:
        short = ours(llm, prompt, max_tokens=12)
        assert short.token_ids == ref[:3] and short.finish_reason == "stop"
        held = ours(llm, prompt, max_tokens=12, min_tokens=6)
        expected = hf_generate(model, prompt, 12, min_new_tokens=6, eos_token_id=eos)
        assert held.token_ids == expected and eos not in held.token_ids[:6]
        stop_tok = ref[1]
        held = ours(llm, prompt, max_tokens=12, min_tokens=4, stop_token_ids=[stop_tok], ignore_eos=True)
        assert stop_tok not in held.token_ids[:4]


def test_presence_and_frequency_penalties_follow_the_formula(llm, path, hf_model):
    """transformers has no such processor: check against the formula on its logits,
    logits - presence * (count > 0) - frequency * count over generated tokens."""
    model = hf_model(path)
    prompt = [11, 12, 13]
    for presence, frequency in [(1.5, 0.0), (0.0, 1.2), (-1.0, 0.5)]:
        got = ours(llm, prompt, presence_penalty=presence, frequency_penalty=frequency, max_tokens=12)
        tokens = list(prompt)
        for _ in range(12):
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1].double()
            counts = torch.bincount(torch.tensor(tokens[len(prompt):], dtype=torch.long),
                                    minlength=logits.shape[0]).double()
            logits -= presence * (counts > 0) + frequency * counts
            tokens.append(int(logits.argmax()))
        assert got.token_ids == tokens[len(prompt):]


def test_processed_logprobs_and_sigmoid(llm, path, hf_model):
    model = hf_model(path)
    prompt = PROMPTS[1]
    ids = [3, 77, 300, 999]
    for act in ("log_softmax", "sigmoid"):
        out = ours(llm, prompt, max_tokens=5, logprob_token_ids=ids, act_func=act)
        raw = hf_logprobs(model, prompt + out.token_ids)  # log_softmax of every position
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.token_ids])).logits[0].float()
        total = 0.0
        for pos, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            row = len(prompt) - 1 + pos
            assert set(entry) == set(ids) | {token}
            for tid, lp in entry.items():
                want = torch.sigmoid(logits[row, tid]) if act == "sigmoid" else raw[row, tid]
                assert lp.logprob == pytest.approx(want.item(), abs=1e-4)
            assert entry[token].rank == int((logits[row] > logits[row, token]).sum()) + 1
            total += raw[row, token].item()
        assert out.cumulative_logprob == pytest.approx(total, abs=1e-3)  # log_softmax whatever act_func
    # processed: after temperature (and penalties), the logprobs of the scaled distribution
    sp = SamplingParams(temperature=0.5, seed=3, max_tokens=4, logprobs=3, logprobs_mode="processed",
                        repetition_penalty=1.3)
    out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    tokens = list(prompt)
    for token, entry in zip(out.token_ids, out.logprobs):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[torch.tensor(tokens)] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / 1.3, logits * 1.3), logits) / 0.5
        ref = logits.log_softmax(-1)
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[tid].item(), abs=1e-4)
        tokens.append(token)


def test_logprob_token_ids_mixed_batch(llm, path, hf_model):
    """Requests with chosen ids, top-N, none, and different act_func share a batch."""
    model = hf_model(path)
    params = [
        SamplingParams(temperature=0, max_tokens=4, logprob_token_ids=[1, 2, 3], act_func="sigmoid"),
        SamplingParams(temperature=0, max_tokens=4, logprobs=2),
        SamplingParams(temperature=0, max_tokens=4),
        SamplingParams(temperature=0, max_tokens=4, extra_args={"activation_func": "sigmoid"},
                       logprob_token_ids=list(range(100, 228))),
    ]
    outs = llm.generate([PROMPTS[0]] * 4, params, use_tqdm=False)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[0] + outs[0].outputs[0].token_ids])).logits[0].float()
    first = len(PROMPTS[0]) - 1
    assert {t: round(lp.logprob, 4) for t, lp in outs[0].outputs[0].logprobs[0].items()} == {
        t: round(torch.sigmoid(logits[first, t]).item(), 4) for t in {1, 2, 3, outs[0].outputs[0].token_ids[0]}}
    top = logits[first].log_softmax(-1).topk(2)
    assert set(outs[1].outputs[0].logprobs[0]) == set(top.indices.tolist())
    assert outs[2].outputs[0].logprobs is None
    assert len(outs[3].outputs[0].logprobs[0]) >= 128


def test_logprob_validation():
    with pytest.raises(ValueError, match="logprob_token_ids holds 129 entries; at most 128"):
        SamplingParams(logprob_token_ids=list(range(129)))
    with pytest.raises(ValueError, match="logprobs=5 contradicts logprob_token_ids"):
        SamplingParams(logprobs=5, logprob_token_ids=[1, 2])
    with pytest.raises(ValueError, match="did you mean 'sigmoid'"):
        SamplingParams(act_func="sigmod")
    with pytest.raises(ValueError, match="did you mean 'sigmoid'"):
        SamplingParams(extra_args={"activation_func": "sigmod"})
    with pytest.raises(ValueError, match="act_func must be one of"):
        SamplingParams(act_func="tanh")
    with pytest.raises(ValueError, match="logprobs_mode"):
        SamplingParams(logprobs_mode="cooked")
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0)
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=3)
    with pytest.raises(ValueError, match="logit_bias\\[5\\]"):
        SamplingParams(logit_bias={5: 500})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=20, max_tokens=10)
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])
    assert SamplingParams(extra_args={"activation_func": "sigmoid"}).act_func == "sigmoid"


def test_truncated_prompts_match_transformers_on_the_kept_tokens(llm, path, hf_model):
    prompt = list(range(20, 60))
    sp = dict(temperature=0, max_tokens=8)
    outs = llm.generate([prompt] * 3, [SamplingParams(**sp, truncate_prompt_tokens=10),
                                       SamplingParams(**sp, truncate_prompt_tokens=10, truncation_side="right"),
                                       SamplingParams(**sp, truncate_prompt_tokens=100)], use_tqdm=False)
    model = hf_model(path)
    for out, kept in zip(outs, (prompt[-10:], prompt[:10], prompt)):
        assert out.prompt_token_ids == kept
        assert out.outputs[0].token_ids == hf_generate(model, kept, 8)
    # -1: what max_model_len (128) leaves beside max_tokens; a prompt longer than the context fits then
    (out,) = llm.generate([list(range(5, 205))], SamplingParams(**sp, truncate_prompt_tokens=-1), use_tqdm=False)
    assert out.prompt_token_ids == list(range(5, 205))[-120:] and len(out.outputs[0].token_ids) <= 8
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(121\) is more than max_model_len - max_tokens"):
        llm.generate([prompt], SamplingParams(**sp, truncate_prompt_tokens=121), use_tqdm=False)


def test_truncation_validation():
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be >= 1, or -1"):
        SamplingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="truncation_side must be one of"):
        SamplingParams(truncate_prompt_tokens=4, truncation_side="both")
    with pytest.raises(ValueError, match="truncation_side applies with truncate_prompt_tokens only"):
        SamplingParams(truncation_side="right")
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be of type int"):
        SamplingParams(truncate_prompt_tokens=True)


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    vocab = llm.engine.model_config.vocab_size
    for kwargs, field in [(dict(logit_bias={vocab: 1.0}), "logit_bias"),
                          (dict(allowed_token_ids=[1, vocab + 5]), "allowed_token_ids"),
                          (dict(logprob_token_ids=[vocab]), "logprob_token_ids")]:
        with pytest.raises(ValueError, match=f"{field} holds token ids outside the vocabulary"):
            llm.generate([[5, 6]], SamplingParams(**kwargs), use_tqdm=False)


@pytest.mark.parametrize("act", ["log_softmax", "sigmoid"])
def test_prompt_logprobs_match_transformers(path, hf_model, act):
    model = hf_model(path)
    prompt = [11, 12, 13, 14, 15, 40, 41, 40, 41, 9, 8, 7, 6, 5, 4, 3, 2]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    ref = logits.sigmoid() if act == "sigmoid" else logits.log_softmax(-1)
    # a tiny token budget splits the prompt into chunks; prefix caching is bypassed
    with LLM(path, max_model_len=64, max_num_batched_tokens=5, block_size=4) as llm:
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # fills the prefix cache
        sp = [SamplingParams(max_tokens=2, prompt_logprobs=3, act_func=act),
              SamplingParams(max_tokens=2, prompt_logprobs=0, logprob_token_ids=[1, 2], act_func=act)]
        outs = llm.generate([prompt, prompt], sp, use_tqdm=False)
    for out, k in zip(outs, (3, 0)):
        plp = out.prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        for pos in range(1, len(prompt)):
            entry = plp[pos]
            row = pos - 1  # logits at position pos - 1 predict prompt token pos
            chosen = logits[row].topk(k).indices.tolist() if k else [1, 2]  # top-k, or logprob_token_ids
            assert set(entry) == set(chosen) | {prompt[pos]}
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(ref[row, tid].item(), abs=1e-4)
            assert entry[prompt[pos]].rank == int((logits[row] > logits[row, prompt[pos]]).sum()) + 1
