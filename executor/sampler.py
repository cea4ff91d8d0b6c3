"""Batched sampling from the per-slot sampling state.

Per step, on the logits of each row's last token:
1. processing, in this order: allowed_token_ids, bad words, min_tokens
   (stop tokens and EOS masked), logit_bias, repetition/presence/frequency
   penalties, custom logits processors;
2. temperature, then top-k, top-p, min-p (as transformers' warpers);
3. greedy rows take the argmax of the processed logits, others a
   Gumbel-max sample keyed by (seed, position, token id);
4. logprobs, for rows that ask, from the raw or the processed logits
   (logprobs_mode), through log_softmax or sigmoid (act_func): the sampled
   token, then the top-N or the requested logprob_token_ids.
Every stage that no row of the batch needs is skipped.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from headrace.executor.input_batch import InputBatch
from headrace.executor.sampling_state import SamplingState
from headrace.executor.staged import upload
from headrace.executor.states import RequestStates
from headrace.kernels import dispatch
from headrace.kernels.logprobs import ACT_LOG_SOFTMAX


class SampledLogprobs:
    """The step's logprobs as pack_logprobs packs them: per row, K columns (the
    sampled token first, then the top-N or the chosen ids; a row uses its
    first k_row) and one more, the sampled token's rank or log_softmax
    (cumulative_logprob sums the latter whatever act_func says)."""

    def __init__(self, ints: np.ndarray, floats: np.ndarray) -> None:
        self.ints = ints.astype("<i4", copy=False)  # [num_rows, K + 1] token ids, then the rank (1 = most likely)
        self.floats = floats.astype("<f4", copy=False)  # [num_rows, K + 1] scores after act_func, then log_softmax
        self._int_bytes, self._float_bytes = self.ints.tobytes(), self.floats.tobytes()
        self._row_bytes = 4 * self.ints.shape[1]

    def sampled_logprob(self, row: int) -> float:
        """Row `row`'s sampled token's log_softmax."""
        return float(self.floats[row, -1])

    def wire(self, row: int, k: int) -> tuple[bytes, bytes, bytes, bytes]:
        """Row `row`'s first k ids and scores, its rank and sampled logprob, as the
        protocol's packed arrays: slices of one buffer per step, not a pack per request."""
        start, end = row * self._row_bytes, (row + 1) * self._row_bytes
        ints, floats = self._int_bytes, self._float_bytes
        return ints[start : start + 4 * k], floats[start : start + 4 * k], ints[end - 4 : end], floats[end - 4 : end]


@dataclass
class ProcessorBatch:
    """What a custom logits processor sees of the batch."""

    slots: np.ndarray  # [num_rows] batch row -> slot
    num_output_tokens: np.ndarray  # [num_rows] tokens generated so far


def sample(
    logits: torch.Tensor,  # [num_rows, vocab] float32 or the model's 16-bit dtype: read as float32
    batch: InputBatch,
    states: RequestStates,
    processors=(),
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """The sampled token per row, and the logprobs packed in two device
    tensors for one host copy each (see SampledLogprobs). Nothing
    here waits for the device. 16-bit logits are widened only where
    something rewrites them (processing, filters, temperature for
    logprobs); the kernels widen them as they read."""
    st = states.sampling
    slots = batch.idx_mapping_np
    idx = batch.idx_mapping
    num_tokens = states.num_tokens[slots]  # [num_rows] tokens: prompt + outputs, sampled ones included
    positions = batch.sample_positions  # where the sampled token goes
    processed = _process(logits, slots, idx, st, states.token_ids.gpu, num_tokens, processors)
    temps = st.temperature.np[slots]
    wants_logprobs = st.num_logprobs.np[slots] >= 0
    if (temps == 0).all():
        sampled = processed.argmax(dim=-1)
        final = processed
    else:
        final = None  # the scaled, filtered logits: made only when something reads them
        if _has_filters(slots, st):
            final = _apply_filters(processed.float() / _scale(st, idx)[:, None], slots, idx, st)
            sampled = dispatch.gumbel_sample(final, st.seed.gpu, positions, rows=idx, counts=st.sample_counts)
            if (temps == 0).any():
                sampled = torch.where(st.temperature.gpu[idx] == 0, processed.argmax(dim=-1), sampled)
        else:
            sampled = sample_by_slot(processed, idx, positions, st)
            if wants_logprobs.any() and st.processed.np[slots].any():  # read by _logprobs
                final = processed.float() / _scale(st, idx)[:, None]
    if not wants_logprobs.any():
        return sampled, None
    return sampled, pack_logprobs(logits, final, sampled, slots, idx, st)


def sample_by_slot(logits: torch.Tensor, idx: torch.Tensor, positions: torch.Tensor, st: SamplingState) -> torch.Tensor:
    """Each row's token from logits the sampler leaves as they are: the kernel reads the row's seed and
    temperature at its slot, scales the row's noise, and takes the argmax for a greedy row. Nothing here
    depends on the host, so the decode graphs capture it (StepGraphs.capture_sampling)."""
    return dispatch.gumbel_sample(logits, st.seed.gpu, positions, st.temperature.gpu, rows=idx,
                                  counts=st.sample_counts)


def plain_rows(slots: np.ndarray, st: SamplingState, processors) -> bool:
    """Whether every row of the batch samples straight from its logits (sample_by_slot): no processing,
    no filter and no logprobs anywhere in the batch."""
    return not processors and bool(st.plain[slots].all())


def _scale(st: SamplingState, idx: torch.Tensor) -> torch.Tensor:  # [num_rows] float32
    """Each row's temperature, 1 for greedy rows (their logits are kept as they are)."""
    temp = st.temperature.gpu[idx]
    return torch.where(temp == 0, 1.0, temp)


def _has_filters(slots, st: SamplingState) -> bool:
    return bool((st.top_k.np[slots] > 0).any() or (st.top_p.np[slots] < 1.0).any() or (st.min_p.np[slots] > 0).any())


def _process(logits, slots, idx, st: SamplingState, token_ids, num_tokens, processors) -> torch.Tensor:
    num_output = num_tokens - st.num_prompt.np[slots]
    allowed = st.has_allowed.np[slots]
    bad_rows = [r for r, s in enumerate(slots.tolist()) if s in st.bad_words]
    min_rows = np.nonzero((st.min_tokens.np[slots] > num_output) & (st.num_stop_ids.np[slots] > 0))[0]
    bias_rows = np.nonzero(st.num_bias.np[slots] > 0)[0]
    pen_rows = np.nonzero((st.repetition.np[slots] != 1) | (st.presence.np[slots] != 0)
                          | (st.frequency.np[slots] != 0))[0]
    if not (allowed.any() or bad_rows or min_rows.size or bias_rows.size or pen_rows.size or processors):
        return logits
    x = logits.to(torch.float32, copy=True)
    dev = x.device
    if allowed.any():
        x.masked_fill_(~st.allowed.gpu[idx] & st.has_allowed.gpu[idx][:, None], float("-inf"))
    if bad_rows:
        rows, toks = _banned_by_bad_words(bad_rows, slots, st)
        if rows:
            x[upload(np.array(rows, dtype=np.int64), dev), upload(np.array(toks, dtype=np.int64), dev)] = float("-inf")
    if min_rows.size:
        _mask_ids(x, min_rows, st.stop_ids.gpu, st.num_stop_ids.gpu, idx)
    if bias_rows.size:
        rows = upload(bias_rows, dev)
        sub = x[rows]
        dispatch.apply_logit_bias(sub, idx[rows], st.bias_ids.gpu, st.bias_values.gpu, st.num_bias.gpu)
        x[rows] = sub
    if pen_rows.size:
        rows = upload(pen_rows, dev)
        sub = x[rows]
        counts, prompt_mask = _token_counts(token_ids, pen_rows, slots, st, num_tokens, x.shape[1])
        ar = torch.arange(len(pen_rows), device=dev)
        dispatch.apply_penalties(sub, ar, counts, prompt_mask, st.repetition.gpu[idx[rows]],
                                 st.presence.gpu[idx[rows]], st.frequency.gpu[idx[rows]])
        x[rows] = sub
    if processors:
        view = ProcessorBatch(slots=slots, num_output_tokens=num_output)
        for proc in processors:
            proc.apply(x, view)
    return x


def _mask_ids(x, rows_np, ids, counts, idx) -> None:
    """For the given rows, ban each of the slot's listed ids (no boolean
    indexing: its nonzero() would wait for the device)."""
    rows = upload(rows_np, x.device)
    slot_rows = idx[rows]
    row_ids = ids[slot_rows]  # [n, max]
    valid = torch.arange(row_ids.shape[1], device=x.device)[None, :] < counts[slot_rows][:, None]
    hits = torch.zeros(len(rows_np), x.shape[1], dtype=torch.int32, device=x.device)
    hits.scatter_add_(1, row_ids.clamp(min=0), valid.int())  # [n, vocab] listed ids
    x[rows] = x[rows].masked_fill(hits > 0, float("-inf"))


def _banned_by_bad_words(bad_rows, slots, st: SamplingState):
    """(row, token) pairs to ban: a bad word's last token, wherever the tokens
    before it end the request's history (transformers' NoBadWordsLogitsProcessor)."""
    rows, toks = [], []
    for r in bad_rows:
        history = st.history[int(slots[r])]
        for seq in st.bad_words[int(slots[r])]:
            prefix = seq[:-1]
            if not prefix or history[len(history) - len(prefix):] == prefix:
                rows.append(r)
                toks.append(seq[-1])
    return rows, toks


def _token_counts(token_ids, rows_np, slots, st: SamplingState, num_tokens, vocab):
    """Per given row: occurrences of each token among its outputs, and which occur in its prompt."""
    dev = token_ids.device
    slot_t = upload(slots[rows_np], dev)
    n_tok = upload(num_tokens[rows_np], dev)
    n_prompt = st.num_prompt.gpu[slot_t].long()
    length = int(num_tokens[rows_np].max())
    tokens = token_ids[slot_t, :length].long()  # [n, length]
    pos = torch.arange(length, device=dev)[None, :]
    is_output = (pos >= n_prompt[:, None]) & (pos < n_tok[:, None])
    counts = torch.zeros(len(rows_np), vocab, dtype=torch.int32, device=dev)
    counts.scatter_add_(1, tokens, is_output.int())
    prompt_mask = torch.zeros(len(rows_np), vocab, dtype=torch.int32, device=dev)
    prompt_mask.scatter_add_(1, tokens, (pos < n_prompt[:, None]).int())
    return counts, prompt_mask > 0


def _apply_filters(scaled: torch.Tensor, slots, idx, st: SamplingState) -> torch.Tensor:
    use_top_k = (st.top_k.np[slots] > 0).any()
    use_top_p = (st.top_p.np[slots] < 1.0).any()
    if use_top_k or use_top_p:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if use_top_k:
            k = st.top_k.gpu[idx].long()
            k = torch.where(k > 0, k, scaled.shape[-1])
            ranks = torch.arange(scaled.shape[-1], device=scaled.device)
            remove |= ranks[None, :] >= k[:, None]
        if use_top_p:
            # Keep the smallest set of most likely tokens whose probability
            # reaches top_p (always at least the top token).
            probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            remove |= mass_before >= st.top_p.gpu[idx][:, None]
            remove[:, 0] = False
        scaled = scaled.scatter(-1, order, sorted_logits.masked_fill(remove, float("-inf")))
    if (st.min_p.np[slots] > 0).any():
        probs = scaled.softmax(dim=-1)
        threshold = st.min_p.gpu[idx][:, None] * probs.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(probs < threshold, float("-inf"))
    return scaled


def pack_logprobs(raw, final, sampled, slots, idx, st: SamplingState) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob columns without a [rows, vocab] logprob tensor: a log-sum-exp
    per row, then gathers."""
    dev = raw.device
    processed = st.processed.np[slots]
    if not processed.any():
        source = raw
    elif processed.all():
        source = final
    else:
        source = torch.where(st.processed.gpu[idx][:, None], final, raw)
    num_n = st.num_logprobs.np[slots]
    num_ids = st.num_lp_ids.np[slots]
    max_n = int(num_n[num_ids == 0].max(initial=0))
    max_ids = int(num_ids.max())
    if not max_ids:  # the sampled token and the top-N only: every logit read once
        return dispatch.top_logprobs(source, sampled, st.act.gpu[idx], max_n)
    k = 1 + max(max_n, max_ids)
    ids = torch.full((len(slots), k), -1, dtype=torch.long, device=dev)
    ids[:, 0] = sampled
    if max_n:
        ids[:, 1 : 1 + max_n] = source.topk(max_n, dim=-1).indices  # rows with fewer use a prefix
    if max_ids:  # the slow path: some rows ask for chosen ids
        filled, _ = dispatch.fill_token_ids(idx, st.lp_ids.gpu, st.num_lp_ids.gpu, sampled)
        id_rows = upload(num_ids > 0, dev)
        ids[:, 1 : 1 + max_ids] = torch.where(id_rows[:, None], filled[:, 1 : 1 + max_ids], ids[:, 1 : 1 + max_ids])
    scores = dispatch.compute_scores(source, ids, st.act.gpu[idx])
    if (st.act.np[slots] == ACT_LOG_SOFTMAX).all():
        sampled_lp = scores[:, 0]  # column 0 is the sampled token, already log_softmax
    else:  # cumulative_logprob sums log_softmax values whatever act_func says
        log_softmax = torch.full((len(slots),), ACT_LOG_SOFTMAX, dtype=torch.int32, device=dev)
        sampled_lp = dispatch.compute_scores(source, sampled[:, None], log_softmax)[:, 0]
    ranks = dispatch.token_ranks(source, sampled)
    # Two device-to-host copies for the lot, made by the caller; int32 and
    # float32, as they go on the wire.
    return torch.cat([ids, ranks[:, None]], dim=1).int(), torch.cat([scores, sampled_lp[:, None]], dim=1)
