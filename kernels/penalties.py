"""Repetition, presence and frequency penalties: torch reference and Triton kernel.

Semantics per row (slot = idx_mapping[row]), for every vocabulary entry v:
- repetition (transformers' RepetitionPenaltyLogitsProcessor, over prompt
  and generated tokens): if v occurred, a positive logit is divided by the
  penalty and a negative one multiplied by it;
- then presence and frequency (OpenAI's, over generated tokens only):
  logit -= presence * (count > 0) + frequency * count.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


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


# Triton: one program per (batch row, vocabulary block). The slot's three
# parameters are scalars of the program; counts and the prompt mask are read
# through the slot, so nothing of size [num_rows, vocab] is gathered.
_PENALTY_BLOCK = 1024


@triton.jit
def _apply_penalties_kernel(
    logits_ptr, logits_stride,
    idx_mapping_ptr,
    counts_ptr, counts_stride,
    prompt_mask_ptr, prompt_mask_stride,  # uint8 view of the bool mask
    repetition_ptr, presence_ptr, frequency_ptr,
    vocab_size,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < vocab_size
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    rep = tl.load(repetition_ptr + slot)
    pres = tl.load(presence_ptr + slot)
    freq = tl.load(frequency_ptr + slot)

    row_ptr = logits_ptr + row.to(tl.int64) * logits_stride + offs
    x = tl.load(row_ptr, mask=mask, other=0.0).to(tl.float32)
    counts = tl.load(counts_ptr + slot * counts_stride + offs, mask=mask, other=0)
    in_prompt = tl.load(prompt_mask_ptr + slot * prompt_mask_stride + offs, mask=mask, other=0) != 0
    generated = counts > 0
    penalized = tl.where(x > 0, x / rep, x * rep)
    x = tl.where(generated | in_prompt, penalized, x)
    x = x - (pres * generated.to(tl.float32) + freq * counts.to(tl.float32))
    tl.store(row_ptr, x.to(logits_ptr.dtype.element_ty), mask=mask)


def apply_penalties(
    logits: torch.Tensor,  # [num_rows, vocab] float32, changed in place
    idx_mapping: torch.Tensor,  # [num_rows] int64, batch row -> slot
    output_counts: torch.Tensor,  # [num_slots, vocab] int32, generated occurrences
    prompt_mask: torch.Tensor,  # [num_slots, vocab] bool, token occurs in the prompt
    repetition: torch.Tensor,  # [num_slots] float32, 1 = off
    presence: torch.Tensor,  # [num_slots] float32, 0 = off
    frequency: torch.Tensor,  # [num_slots] float32, 0 = off
) -> None:
    """Triton version of apply_penalties_ref (same semantics, in place)."""
    num_rows, vocab_size = logits.shape
    assert logits.stride(-1) == 1 and output_counts.stride(-1) == 1 and prompt_mask.stride(-1) == 1
    if num_rows == 0 or vocab_size == 0:
        return
    grid = (num_rows, triton.cdiv(vocab_size, _PENALTY_BLOCK))
    _apply_penalties_kernel[grid](
        logits, logits.stride(0),
        idx_mapping,
        output_counts, output_counts.stride(0),
        prompt_mask.view(torch.uint8), prompt_mask.stride(0),
        repetition, presence, frequency,
        vocab_size,
        BLOCK=_PENALTY_BLOCK,
    )


def apply_logit_bias_ref(
    logits: torch.Tensor,  # [num_rows, vocab] float32, changed in place
    idx_mapping: torch.Tensor,  # [num_rows] int64, batch row -> slot
    bias_ids: torch.Tensor,  # [num_slots, max_bias] int64, the slot's biased token ids
    bias_values: torch.Tensor,  # [num_slots, max_bias] float32
    num_bias: torch.Tensor,  # [num_slots] int32, entries in use
) -> None:
    """Add each slot's logit_bias entries to its rows (ids within a slot are distinct)."""
    ids = bias_ids[idx_mapping]
    valid = torch.arange(ids.shape[1], device=ids.device)[None, :] < num_bias[idx_mapping][:, None]
    rows = torch.arange(len(idx_mapping), device=ids.device)[:, None].expand_as(ids)
    logits.index_put_((rows[valid], ids[valid]), bias_values[idx_mapping][valid], accumulate=True)


@triton.jit
def _apply_logit_bias_kernel(
    logits_ptr, logits_stride,
    idx_mapping_ptr,
    ids_ptr, values_ptr, bias_stride,
    num_bias_ptr,
    BLOCK: tl.constexpr,
):
    # One program per (row, block of bias entries); ids within a slot are
    # distinct, so no two lanes touch the same logit.
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    mask = offs < tl.load(num_bias_ptr + slot)
    ids = tl.load(ids_ptr + slot * bias_stride + offs, mask=mask, other=0)
    values = tl.load(values_ptr + slot * bias_stride + offs, mask=mask, other=0.0)
    ptrs = logits_ptr + row.to(tl.int64) * logits_stride + ids
    x = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, x + values, mask=mask)


def apply_logit_bias(
    logits: torch.Tensor,  # [num_rows, vocab] float32, changed in place
    idx_mapping: torch.Tensor,  # [num_rows] int64
    bias_ids: torch.Tensor,  # [num_slots, max_bias] int64
    bias_values: torch.Tensor,  # [num_slots, max_bias] float32
    num_bias: torch.Tensor,  # [num_slots] int32
) -> None:
    """Triton version of apply_logit_bias_ref."""
    assert logits.stride(-1) == 1 and bias_ids.stride() == bias_values.stride()
    if len(idx_mapping) == 0:
        return
    block = 128
    grid = (len(idx_mapping), triton.cdiv(bias_ids.shape[1], block))
    _apply_logit_bias_kernel[grid](logits, logits.stride(0), idx_mapping, bias_ids, bias_values,
                                   bias_ids.stride(0), num_bias, BLOCK=block)
