"""Batched sampling from the per-slot sampling state.

Order of filters, as transformers applies its warpers: temperature, top-k,
top-p, min-p; then Gumbel-max with the counter-based random source. Work no
row needs is skipped: an all-greedy batch only takes an argmax, and
log-softmax statistics are computed only when some row asks for logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from headrace.executor.input_batch import InputBatch
from headrace.executor.states import RequestStates
from headrace.kernels.sampling import gumbel_ref


@dataclass
class SampledLogprobs:
    """Raw (log_softmax of the model's logits) logprobs of each row.

    Column 0 is the sampled token, columns 1.. the top-N in rank order.
    """

    token_ids: np.ndarray  # [num_rows, 1 + max_n] int64
    logprobs: np.ndarray  # [num_rows, 1 + max_n] float32
    sampled_ranks: np.ndarray  # [num_rows] int64, 1 = most likely


def sample(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    batch: InputBatch,
    states: RequestStates,
) -> tuple[torch.Tensor, SampledLogprobs | None]:
    idx = batch.idx_mapping
    temperature = states.temperature.np[batch.idx_mapping_np]
    greedy_ids = logits.argmax(dim=-1)
    if (temperature == 0).all():
        sampled = greedy_ids
    else:
        temp = states.temperature.gpu[idx]
        greedy = temp == 0
        scaled = logits / torch.where(greedy, 1.0, temp)[:, None]
        scaled = _apply_filters(scaled, batch, states)
        positions = torch.from_numpy(batch.seq_lens_np).to(logits.device)  # the new token's position
        noise = gumbel_ref(states.seed.gpu[idx], positions, logits.shape[-1])
        sampled = torch.where(greedy, greedy_ids, (scaled + noise).argmax(dim=-1))

    num_logprobs = states.num_logprobs.np[batch.idx_mapping_np]
    max_n = int(num_logprobs.max())
    if max_n < 0:
        return sampled, None
    return sampled, _logprobs(logits, sampled, max_n)


def _apply_filters(scaled: torch.Tensor, batch: InputBatch, states: RequestStates) -> torch.Tensor:
    rows = batch.idx_mapping_np
    idx = batch.idx_mapping
    use_top_k = (states.top_k.np[rows] > 0).any()
    use_top_p = (states.top_p.np[rows] < 1.0).any()
    if use_top_k or use_top_p:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if use_top_k:
            k = states.top_k.gpu[idx].long()
            k = torch.where(k > 0, k, scaled.shape[-1])
            ranks = torch.arange(scaled.shape[-1], device=scaled.device)
            remove |= ranks[None, :] >= k[:, None]
        if use_top_p:
            # Keep the smallest set of most likely tokens whose probability
            # reaches top_p (always at least the top token).
            probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            remove |= mass_before >= states.top_p.gpu[idx][:, None]
            remove[:, 0] = False
        scaled = scaled.scatter(-1, order, sorted_logits.masked_fill(remove, float("-inf")))
    if (states.min_p.np[rows] > 0).any():
        probs = scaled.softmax(dim=-1)
        threshold = states.min_p.gpu[idx][:, None] * probs.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(probs < threshold, float("-inf"))
    return scaled


def _logprobs(logits: torch.Tensor, sampled: torch.Tensor, max_n: int) -> SampledLogprobs:
    """Top-N logprobs from the row max and log-sum-exp, with no [rows, vocab] logprob tensor."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [num_rows, 1]
    sampled_logits = logits.gather(-1, sampled[:, None])
    ranks = (logits > sampled_logits).sum(dim=-1) + 1
    top_logits, top_ids = logits.topk(max_n, dim=-1) if max_n else (logits[:, :0], sampled[:, None][:, :0])
    ids = torch.cat([sampled[:, None], top_ids], dim=-1)
    lps = torch.cat([sampled_logits, top_logits], dim=-1) - lse
    return SampledLogprobs(ids.cpu().numpy(), lps.cpu().numpy(), ranks.cpu().numpy())
