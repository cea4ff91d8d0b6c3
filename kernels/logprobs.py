"""Scores of chosen token ids, and ranks: torch references.

compute_scores gathers, for each row, the score of each listed token id
under the row's activation: log_softmax(logits)[id] (act 0) or
sigmoid(logits[id]) (act 1). Nothing of size [rows, vocab] is materialised
but the logits themselves: the log-sum-exp is a row reduction.
"""
from __future__ import annotations

import torch

ACT_LOG_SOFTMAX = 0
ACT_SIGMOID = 1


def compute_scores_ref(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    token_ids: torch.Tensor,  # [num_rows, k] int64, -1 = no token (score left 0)
    act: torch.Tensor,  # [num_rows] int32, ACT_LOG_SOFTMAX or ACT_SIGMOID
) -> torch.Tensor:  # [num_rows, k] float32
    valid = token_ids >= 0
    picked = logits.gather(-1, token_ids.clamp(min=0))
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    scores = torch.where(act[:, None] == ACT_SIGMOID, torch.sigmoid(picked), picked - lse)
    return torch.where(valid, scores, 0.0)


def token_ranks_ref(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    token_ids: torch.Tensor,  # [num_rows] int64
) -> torch.Tensor:  # [num_rows] int64, 1 = the most likely token
    picked = logits.gather(-1, token_ids[:, None])
    return (logits > picked).sum(dim=-1) + 1


def fill_token_ids_ref(
    idx_mapping: torch.Tensor,  # [num_rows] int64
    slot_ids: torch.Tensor,  # [num_slots, max_ids] int32, the slot's logprob_token_ids
    num_slot_ids: torch.Tensor,  # [num_slots] int32, how many are set
    sampled: torch.Tensor,  # [num_rows] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # ids [num_rows, 1 + max_ids] int64 (-1 padded), valid mask
    """Per row: the sampled token, then the slot's requested ids."""
    ids = slot_ids[idx_mapping].long()
    valid = torch.arange(ids.shape[1], device=ids.device)[None, :] < num_slot_ids[idx_mapping][:, None]
    ids = torch.where(valid, ids, -1)
    ids = torch.cat([sampled[:, None], ids], dim=1)
    valid = torch.cat([torch.ones_like(valid[:, :1]), valid], dim=1)
    return ids, valid
