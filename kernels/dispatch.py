"""Which implementation of each kernel a tensor gets: the Triton
launcher on a CUDA device, the torch reference elsewhere."""
from __future__ import annotations

import torch

from headrace.kernels import (
    activation, beam, input_prep, logprobs, norm, penalties, qkv, sampling,
)


def _pick(ref, name: str, module):
    launcher = getattr(module, name, None)

    def run(first: torch.Tensor, *args, **kwargs):
        fn = launcher if launcher is not None and first.is_cuda else ref
        return fn(first, *args, **kwargs)

    run.__name__ = name
    return run


apply_penalties = _pick(penalties.apply_penalties_ref, "apply_penalties", penalties)
apply_logit_bias = _pick(penalties.apply_logit_bias_ref, "apply_logit_bias", penalties)
compute_scores = _pick(logprobs.compute_scores_ref, "compute_scores", logprobs)
token_ranks = _pick(logprobs.token_ranks_ref, "token_ranks", logprobs)
top_logprobs = _pick(logprobs.top_logprobs_ref, "top_logprobs", logprobs)
fill_token_ids = _pick(logprobs.fill_token_ids_ref, "fill_token_ids", logprobs)
gumbel_sample = _pick(sampling.gumbel_sample_ref, "gumbel_sample", sampling)
rms_norm = _pick(norm.rms_norm_ref, "rms_norm", norm)
rope_and_cache = _pick(qkv.rope_and_cache_ref, "rope_and_cache", qkv)
silu_and_mul = _pick(activation.silu_and_mul_ref, "silu_and_mul", activation)
prepare_inputs = _pick(input_prep.prepare_inputs_ref, "prepare_inputs", input_prep)
advance_slots = _pick(input_prep.advance_slots_ref, "advance_slots", input_prep)
copy_partial_blocks = _pick(beam.copy_partial_blocks_ref, "copy_partial_blocks", beam)
