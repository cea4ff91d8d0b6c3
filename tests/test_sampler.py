"""The sampler's filters against transformers' logits warpers, and its edge cases."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from headrace.executor.sampler import _apply_filters, _has_filters, _process, plain_rows, sample
from headrace.executor.sampling_state import SamplingState
from headrace.executor.states import RequestStates
from headrace.sampling_params import SamplingParams
from headrace.step import NewRequestData


class _Batch:
    """The fields of InputBatch that the sampler reads."""

    def __init__(self, slots, seq_lens):
        self.idx_mapping_np = np.asarray(slots, dtype=np.int64)
        self.idx_mapping = torch.from_numpy(self.idx_mapping_np)
        self.set_seq_lens(seq_lens)

    def set_seq_lens(self, seq_lens):
        self.seq_lens_np = np.asarray(seq_lens, dtype=np.int64)
        self.attn = SimpleNamespace(seq_lens=torch.from_numpy(self.seq_lens_np.astype(np.int32)))
        self.sample_positions = torch.from_numpy(self.seq_lens_np)  # int64, as input preparation uploads it


def make_states(params: list[SamplingParams], seeds=None, vocab=300) -> tuple[RequestStates, _Batch]:
    cpu = torch.device("cpu")
    states = RequestStates(len(params) + 2, 64, 4, cpu, SamplingState(len(params) + 2, vocab, [1], False, cpu))
    for i, sp in enumerate(params):
        seed = seeds[i] if seeds else i
        states.add(NewRequestData(f"r{i}", [1, 2, 3], 3, [0], 0, sp, seed))
    states.apply_staged()
    slots = [states.req_to_slot[f"r{i}"] for i in range(len(params))]
    return states, _Batch(slots, [3] * len(params))


def hf_filtered(logits, sp: SamplingParams):
    scores = TemperatureLogitsWarper(sp.temperature)(None, logits.clone())
    if sp.top_k > 0:
        scores = TopKLogitsWarper(sp.top_k)(None, scores)
    if sp.top_p < 1:
        scores = TopPLogitsWarper(sp.top_p)(None, scores)
    if sp.min_p > 0:
        scores = MinPLogitsWarper(sp.min_p)(None, scores)
    return scores


CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.5, min_p=0.2),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=2.0, top_p=0.01),
]


def test_filters_match_transformers_warpers():
    torch.manual_seed(0)
    logits = torch.randn(len(CASES), 300) * 3
    states, batch = make_states(CASES)
    temps = torch.tensor([sp.temperature for sp in CASES])
    ours = _apply_filters(logits / temps[:, None], batch.idx_mapping_np, batch.idx_mapping, states.sampling)
    for i, sp in enumerate(CASES):
        ref = hf_filtered(logits[i : i + 1], sp)[0]
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(ref)), f"kept set differs for {sp}"
        kept = ~torch.isinf(ref)
        torch.testing.assert_close(ours[i][kept], ref[kept])


def test_sample_respects_filters_and_greedy_rows():
    torch.manual_seed(1)
    logits = torch.randn(4, 200) * 2
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=3),
              SamplingParams(temperature=5.0, top_p=0.3), SamplingParams(temperature=0)]
    for seed in range(30):
        states, batch = make_states(params, seeds=[seed] * 4, vocab=200)
        batch.set_seq_lens(np.full(4, seed))
        tokens, lps = sample(logits, batch, states)
        assert lps is None
        assert tokens[0] == logits[0].argmax() and tokens[3] == logits[3].argmax()
        assert tokens[1] in logits[1].topk(3).indices
        kept = ~torch.isinf(hf_filtered(logits[2:3], params[2])[0])
        assert kept[tokens[2]]


def test_sample_reads_bf16_logits_as_their_float32_widening():
    """The model runner passes the LM head's bf16 logits: every path (greedy, temperature, filters,
    penalties, logprobs of raw and processed logits) samples and scores as on the widened float32."""
    torch.manual_seed(2)
    logits = (torch.randn(6, 200) * 3).bfloat16()
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.8, logprobs=2),
              SamplingParams(temperature=1.0, top_k=5, logprobs=1, logprobs_mode="processed"),
              SamplingParams(temperature=0.7, presence_penalty=0.5, repetition_penalty=1.2),
              SamplingParams(temperature=1.2, top_p=0.7, logprobs=0), SamplingParams(temperature=0.6)]
    for seed in range(8):
        outs = []
        for x in (logits, logits.float()):
            states, batch = make_states(params, seeds=[seed * 10 + i for i in range(6)], vocab=200)
            batch.set_seq_lens(np.full(6, 3 + seed))
            outs.append(sample(x, batch, states))
        (tok16, lp16), (tok32, lp32) = outs
        assert torch.equal(tok16, tok32)
        assert torch.equal(lp16[0], lp32[0]) and torch.equal(lp16[1], lp32[1])


def test_sampling_params_validation():
    for kwargs, field in [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=21), "logprobs"),
        (dict(n=0), "n"),
        (dict(n=1000), "n"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(seed=2**64), "seed"),
        (dict(temperature=float("nan")), "temperature"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


PLAIN = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(temperature=0.6, seed=5),
         SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True, stop_token_ids=[9])]
NOT_PLAIN = [SamplingParams(top_k=5), SamplingParams(top_p=0.9), SamplingParams(min_p=0.1),
             SamplingParams(repetition_penalty=1.2), SamplingParams(presence_penalty=0.5),
             SamplingParams(frequency_penalty=0.5), SamplingParams(logit_bias={7: 5.0}),
             SamplingParams(allowed_token_ids=[3, 4]), SamplingParams(bad_words_token_ids=[[5]]),
             SamplingParams(min_tokens=4), SamplingParams(logprobs=0), SamplingParams(logprobs=2),
             SamplingParams(logprob_token_ids=[3]), SamplingParams(n=1, best_of=2)]


@pytest.mark.parametrize("sp", PLAIN + NOT_PLAIN)
def test_plain_rows_agree_with_the_sampler_stages(sp):
    """A request is plain (its decode steps may sample in a graph, which runs sample_by_slot alone) exactly
    when the eager sampler would run no processing, no filter and no logprobs for it."""
    states, batch = make_states([sp])
    st, slots = states.sampling, batch.idx_mapping_np
    logits = torch.randn(1, 300)
    unprocessed = _process(logits, slots, batch.idx_mapping, st, states.token_ids.gpu, states.num_tokens[slots],
                           ()) is logits
    stages_off = unprocessed and not _has_filters(slots, st) and not (st.num_logprobs.np[slots] >= 0).any()
    assert plain_rows(slots, st, ()) == stages_off == (sp in PLAIN)


@pytest.mark.parametrize("sp", [SamplingParams(prompt_logprobs=1), SamplingParams(use_beam_search=True, n=2, temperature=0)])
def test_plain_rows_leave_out_prompt_logprobs_and_beams(sp):
    """Rows the sampler's stages leave alone, but whose steps need the eager path: prompt logprobs read the
    hidden states, beams are selected from the logits."""
    states, batch = make_states([sp])
    assert not plain_rows(batch.idx_mapping_np, states.sampling, ())


def test_plain_rows_need_every_row_plain_and_no_custom_processors():
    states, batch = make_states([SamplingParams(), SamplingParams(top_k=3), SamplingParams(temperature=0)])
    st, slots = states.sampling, batch.idx_mapping_np
    assert plain_rows(slots[[0, 2]], st, ()) and not plain_rows(slots, st, ())
    assert not plain_rows(slots[[0, 2]], st, (object(),))
