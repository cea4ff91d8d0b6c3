"""Beam search and best_of against transformers' generate on the same checkpoints. The engines that
are compared with transformers' float32 numbers run in float32 on either device (a GPU would otherwise
take bfloat16)."""
from __future__ import annotations

import asyncio
import itertools
import random

import pytest
import torch

from headrace import LLM, AsyncEngine, BeamSearchParams, SamplingParams
from headrace.config import EngineArgs
from headrace.core.engine import EngineCore
from headrace.sampling_params import RequestOutputKind
from headrace.testing.checkpoint import copy_with_eos
from tests.conftest import ARCHS, assert_blocks_free, hf_logprobs

MAX_TOKENS = 10


def prompts(vocab: int, lengths, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]


def beam_params(width, n, length_penalty=1.0, early_stopping=False, max_tokens=MAX_TOKENS, **kw):
    return SamplingParams(use_beam_search=True, best_of=width, n=n, temperature=0.0, max_tokens=max_tokens,
                          length_penalty=length_penalty, early_stopping=early_stopping, **kw)


def hf_beams(model, prompt, sp: SamplingParams, eos):
    """transformers' beam search: [(generated ids, sequence score)] best first."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), num_beams=sp.best_of, num_return_sequences=sp.n,
                             do_sample=False, max_new_tokens=sp.max_tokens, length_penalty=sp.length_penalty,
                             early_stopping=sp.early_stopping, eos_token_id=eos, pad_token_id=eos,
                             output_scores=True, return_dict_in_generate=True, attention_mask=None)
    result = []
    for seq, score in zip(out.sequences, out.sequences_scores):
        ids = seq[len(prompt):].tolist()
        if eos in ids:  # padding after the hypothesis' EOS
            ids = ids[: ids.index(eos) + 1]
        result.append((ids, float(score)))
    return result


def check_beams(out, ref, sp: SamplingParams, eos, per_token: bool = False) -> None:
    """out's beams equal transformers' (ref, from hf_beams); scores within
    1e-4, or with per_token within 1e-4 a token (a real model's logprobs
    agree to 1e-4 a position, and a sum of them adds the differences up)."""
    assert len(out.outputs) == sp.n
    for i, (c, (ids, score)) in enumerate(zip(out.outputs, ref)):
        assert c.index == i
        assert c.token_ids == ids, f"beam {i} of {sp.best_of} (length_penalty={sp.length_penalty}, " \
                                   f"early_stopping={sp.early_stopping}) diverged"
        tol = 1e-4 * (len(ids) ** (1 - sp.length_penalty) if per_token else 1)
        assert c.cumulative_logprob / len(ids) ** sp.length_penalty == pytest.approx(score, abs=tol)
        assert c.finish_reason == ("stop" if ids[-1] == eos else "length")


@pytest.fixture(scope="module")
def eos_checkpoints(tmp_path_factory):
    """Per arch, a checkpoint whose EOS is the second most likely first token
    after the first test prompt, so that hypotheses finish early."""
    made = {}

    def build(checkpoint, hf_model, arch):
        if arch not in made:
            path = checkpoint(arch)
            model = hf_model(path)
            first = prompts(model.config.vocab_size, [7, 23], seed=1)[0]
            eos = int(hf_logprobs(model, first)[-1].topk(2).indices[1])
            made[arch] = (copy_with_eos(path, tmp_path_factory.mktemp(arch) / "eos", eos), eos)
        return made[arch]

    return build


@pytest.mark.parametrize("arch", ARCHS)
def test_beam_search_matches_transformers(arch, checkpoint, hf_model, eos_checkpoints):
    """Every width, n, length_penalty and early_stopping of the issue, in one
    batch mixed with plain requests, against transformers' beam search."""
    path, eos = eos_checkpoints(checkpoint, hf_model, arch)
    model = hf_model(path)
    llm = LLM(path, max_model_len=256, dtype="float32")
    ps = prompts(llm.engine.model_config.vocab_size, [7, 23], seed=1)
    combos = [beam_params(w, n, lp, es) for w, lp, es in itertools.product((2, 4), (0.0, 1.0, 2.0),
                                                                          (True, False, "never")) for n in (1, w)]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    batch = [(p, sp) for sp in combos for p in ps] + [(p, greedy) for p in ps]
    outs = llm.generate([p for p, _ in batch], [sp for _, sp in batch], use_tqdm=False)
    stopped = 0
    for (p, sp), out in zip(batch, outs):
        if sp.use_beam_search:
            ref = hf_beams(model, p, sp, eos)
            check_beams(out, ref, sp, eos)
            stopped += sum(ids[-1] == eos for ids, _ in ref)
    assert stopped > 0, "no hypothesis ended by EOS: the test would not cover finished hypotheses"
    assert_blocks_free(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_beam_search_chunked_prefill_preemption_no_prefix_cache(arch, checkpoint, hf_model, eos_checkpoints):
    path, eos = eos_checkpoints(checkpoint, hf_model, arch)
    model = hf_model(path)
    ps = prompts(model.config.vocab_size, [40, 45, 50, 30, 60, 35], seed=2)
    sp = beam_params(4, 4, max_tokens=24)
    # 40 blocks of 8 tokens: one group fits (prompt once, 4 beams of 24 tokens), six do not.
    for kwargs in (dict(num_kv_blocks=40, block_size=8, max_num_batched_tokens=16),
                   dict(enable_prefix_caching=False, max_num_batched_tokens=7),
                   dict(async_scheduling=False, num_kv_blocks=40, block_size=8)):
        llm = LLM(path, max_model_len=128, dtype="float32", **kwargs)
        outs = llm.generate(ps, sp, use_tqdm=False)
        for p, out in zip(ps, outs):
            check_beams(out, hf_beams(model, p, sp, eos), sp, eos)
        if "num_kv_blocks" in kwargs:
            assert llm.engine.scheduler.num_preemptions > 0
        assert_blocks_free(llm)
        llm.shutdown()


def test_beams_share_the_prompt_blocks_and_abort_frees_them(checkpoint):
    path = checkpoint("llama")
    engine = EngineCore(EngineArgs(model=str(path), max_model_len=1024, block_size=16))
    total = engine.cache_config.num_blocks
    prompt = prompts(engine.model_config.vocab_size, [1000])[0]
    engine.add_request("b", prompt, beam_params(4, 4, max_tokens=20), 0.0)
    for _ in range(6):  # the prompt (one chunk of 1000), then beam steps
        engine.step()
    group = engine.scheduler.requests["b#beam0"].group
    assert group.num_generated >= 3
    used = total - engine.scheduler.kv.num_free_blocks
    prompt_blocks = 1000 // 16  # full blocks, shared; each beam has its own copy of the partial 63rd
    assert used <= prompt_blocks + 4 * 2, f"{used} blocks in use: the prompt is held more than once"
    shared = engine.scheduler.kv.pool.ref_counts[group.home.block_ids[0]]
    assert shared == 4
    engine.abort(["b"])
    assert engine.scheduler.kv.num_free_blocks == total
    assert not engine.scheduler.requests and not engine.live("b")
    engine.close()


@pytest.mark.parametrize("width", [2, 4])
def test_beam_logprobs_match_transformers(width, checkpoint, hf_model):
    path = checkpoint("qwen3")
    model = hf_model(path)
    llm = LLM(path, max_model_len=128, dtype="float32")
    p = prompts(llm.engine.model_config.vocab_size, [9], seed=3)[0]
    out = llm.generate([p], beam_params(width, width, logprobs=2), use_tqdm=False)[0]
    for c in out.outputs:
        ref = hf_logprobs(model, p + c.token_ids)[len(p) - 1 : -1]  # [generated, vocab]
        assert len(c.logprobs) == len(c.token_ids)
        for pos, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            assert entry[tok].logprob == pytest.approx(float(ref[pos, tok]), abs=1e-4)
            top = ref[pos].topk(2).indices.tolist()
            assert all(t in entry for t in top)
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)),
                                                     abs=1e-4)


def test_llm_beam_search_and_temperature(checkpoint, hf_model):
    path = checkpoint("qwen2")
    model = hf_model(path)
    llm = LLM(path, max_model_len=128, dtype="float32")
    ps = prompts(llm.engine.model_config.vocab_size, [5, 12], seed=4)
    outs = llm.beam_search(ps, BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    for p, out in zip(ps, outs):
        assert len(out.sequences) == 3
        ref = hf_beams(model, p, beam_params(3, 3, max_tokens=8), eos=None)
        for seq, (ids, score) in zip(out.sequences, ref):
            assert seq.tokens == p + ids
            assert seq.cum_logprob / len(ids) == pytest.approx(score, abs=1e-4)
    # temperature divides the logits before the scores: transformers' beam search on logits / 2.
    hot = llm.beam_search(ps[:1], BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True, temperature=2.0))
    # (transformers' beam search ignores temperature without sampling: the reference is written out here.)
    scaled = _scaled_beam_reference(model, ps[0], width=2, steps=6, temperature=2.0)
    assert [s.tokens[len(ps[0]):] for s in hot[0].sequences] == scaled


def _scaled_beam_reference(model, prompt, width, steps, temperature):
    """A plain beam search (no EOS) on log_softmax(logits / temperature), by full forward passes."""
    beams = [(0.0, [])]
    for _ in range(steps):
        cands = []
        for score, ids in beams:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + ids])).logits[0, -1].float()
            lp = (logits / temperature).log_softmax(-1)
            vals, toks = lp.topk(2 * width)
            cands += [(score + float(v), ids + [int(t)]) for v, t in zip(vals, toks)]
        beams = sorted(cands, key=lambda c: -c[0])[:width]
    return [ids for _, ids in beams]


def test_best_of_returns_the_most_likely_samples(checkpoint):
    path = checkpoint("llama")
    llm = LLM(path, max_model_len=128)
    p = prompts(llm.engine.model_config.vocab_size, [8], seed=6)[0]
    every = llm.generate([p], SamplingParams(n=5, seed=11, max_tokens=6, logprobs=0), use_tqdm=False)[0]
    best = llm.generate([p], SamplingParams(n=2, best_of=5, seed=11, max_tokens=6), use_tqdm=False)[0]
    ranked = sorted(every.outputs, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
    assert [c.index for c in best.outputs] == [0, 1]
    for got, want in zip(best.outputs, ranked):
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-5)
        assert got.logprobs is None  # not asked for
    assert_blocks_free(llm)


def test_beam_streams_cumulative_and_refuses_delta(checkpoint, hf_model):
    path = checkpoint("llama")
    sp = beam_params(3, 2, max_tokens=8, ignore_eos=True)
    model = hf_model(path)
    prompt = prompts(model.config.vocab_size, [6])[0]

    async def main():
        async with AsyncEngine.from_model(str(path), max_model_len=128) as engine:
            seen = []
            async for out in engine.generate(prompt, sp):
                seen.append([c.token_ids for c in out.outputs])
            final = out
            with pytest.raises(ValueError, match="DELTA"):
                beam_params(2, 1, output_kind=RequestOutputKind.DELTA)
            return seen, final

    seen, final = asyncio.run(main())
    assert all(len(s) == 2 for s in seen) and final.finished
    lengths = [len(s[0]) for s in seen]
    assert lengths == sorted(lengths) and lengths[-1] == 8  # the best 2 so far, growing
    ref = hf_beams(model, prompt, sp, eos=None)
    assert [c.token_ids for c in final.outputs] == [ids for ids, _ in ref]


@pytest.mark.parametrize("kwargs, match", [
    (dict(n=3, best_of=2), "best_of must be >= n"),
    (dict(best_of=129), "best_of"),
    (dict(use_beam_search=True, best_of=2), "temperature must be 0"),
    (dict(use_beam_search=True, best_of=2, temperature=0, top_p=0.5), "top_p"),
    (dict(use_beam_search=True, best_of=2, temperature=0, top_k=5), "top_k"),
    (dict(use_beam_search=True, best_of=2, temperature=0, min_p=0.1), "min_p"),
    (dict(use_beam_search=True, best_of=2, temperature=0, max_tokens=None), "max_tokens"),
    (dict(use_beam_search=True, best_of=2, temperature=0, length_penalty=float("inf")), "length_penalty"),
    (dict(use_beam_search=True, best_of=2, temperature=0, early_stopping="sometimes"), "early_stopping"),
    (dict(use_beam_search=True, best_of=2, temperature=0, repetition_penalty=1.2), "repetition_penalty"),
    (dict(length_penalty=2.0), "length_penalty applies to beam search only"),
    (dict(early_stopping=True), "early_stopping applies to beam search only"),
    (dict(n=1, best_of=3, output_kind=RequestOutputKind.DELTA), "DELTA"),
])
def test_bad_beam_params_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_engine_refuses_groups_it_cannot_hold(checkpoint):
    path = checkpoint("llama")
    engine = EngineCore(EngineArgs(model=str(path), max_model_len=64, max_num_seqs=4, block_size=8,
                                   num_kv_blocks=16))
    with pytest.raises(ValueError, match="max_num_seqs=4"):
        engine.add_request("a", [5, 6, 7], beam_params(8, 1), 0.0)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("b", [5, 6, 7], beam_params(4, 1, max_tokens=60), 0.0)
    assert not engine.scheduler.requests
    engine.close()


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_beam_search_stop_strings_match_transformers(include, device, checkpoint, hf_model):
    from transformers import AutoTokenizer

    path = checkpoint("llama")
    model, tok = hf_model(path), AutoTokenizer.from_pretrained(str(path))
    llm = LLM(path, max_model_len=128, device=device, dtype="float32")
    p = prompts(llm.engine.model_config.vocab_size, [8], seed=7)[0]
    free = llm.generate([p], beam_params(3, 1, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop = next(free.text[i : i + 2] for i in range(3, len(free.text)) if free.text[i : i + 2].isascii()
                and free.text[i : i + 2].strip())
    # length_penalty 0 ranks by the plain sum: the shorter hypothesis the stop string ends comes first
    sp = beam_params(3, 3, 0.0, max_tokens=12, ignore_eos=True, stop=[stop], include_stop_str_in_output=include)
    out = llm.generate([p], sp, use_tqdm=False)[0]
    pad = llm.engine.model_config.vocab_size - 1
    with torch.no_grad():
        ref = model.generate(torch.tensor([p]), num_beams=3, num_return_sequences=3, do_sample=False,
                             max_new_tokens=12, length_penalty=0.0, stop_strings=[stop], tokenizer=tok,
                             eos_token_id=None,
                             pad_token_id=pad, attention_mask=None)
    stopped = 0
    for c, row in zip(out.outputs, ref[:, len(p):].tolist()):
        assert row[: len(c.token_ids)] == c.token_ids and all(t in (pad, -1) for t in row[len(c.token_ids):])
        if c.stop_reason == stop:
            stopped += 1
            assert c.finish_reason == "stop"
            whole = tok.decode(c.token_ids, skip_special_tokens=True)
            assert c.text == whole[: whole.index(stop) + (len(stop) if include else 0)]
    assert stopped, f"no beam ended on the stop string {stop!r}: {free.text!r} {[c.text for c in out.outputs]}"
    assert_blocks_free(llm)
