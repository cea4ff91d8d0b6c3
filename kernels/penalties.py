"""Repetition, presence and frequency penalties: torch reference.

Semantics per row (slot = idx_mapping[row]), for every vocabulary entry v:
- repetition (transformers' RepetitionPenaltyLogitsProcessor, over prompt
  and generated tokens): if v occurred, a positive logit is divided by the
  penalty and a negative one multiplied by it;
- then presence and frequency (OpenAI's, over generated tokens only):
  logit -= presence * (count > 0) + frequency * count.
"""
from __future__ import annotations

import torch


def apply_penalties_ref(
    logits: torch.Tensor,  # [num_rows, vocab] float32, changed in place
    idx_mapping: torch.Tensor,  # [num_rows] int64, batch row -> slot
    output_counts: torch.Tensor,  # [num_slots, vocab] int32, generated occurrences
    prompt_mask: torch.Tensor,  # [num_slots, vocab] bool, token occurs in the prompt
    repetition: torch.Tensor,  # [num_slots] float32, 1 = off
    presence: torch.Tensor,  # [num_slots] float32, 0 = off
    frequency: torch.Tensor,  # [num_slots] float32, 0 = off
) -> None:
    counts = output_counts[idx_mapping].float()
    seen = (counts > 0) | prompt_mask[idx_mapping]
    rep = repetition[idx_mapping][:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalized, logits))
    logits -= presence[idx_mapping][:, None] * (counts > 0) + frequency[idx_mapping][:, None] * counts
