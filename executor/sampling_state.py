"""The batch's sampling parameters as per-slot tensors (our SamplingMetadata).

Written once per request through staged writes when it takes a slot, read
every step by batched ops through idx_mapping. Host mirrors of the small
per-slot fields let the sampler skip every stage no row of the batch needs.
"""
from __future__ import annotations

import numpy as np
import torch

from headrace.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROB_TOKEN_IDS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from headrace.executor.staged import StagedTensor
from headrace.kernels.logprobs import ACT_LOG_SOFTMAX, ACT_SIGMOID

_U64 = (1 << 64) - 1


class SamplingState:
    def __init__(self, num_slots: int, vocab_size: int, eos_token_ids, default_processed: bool,
                 device: torch.device) -> None:
        S, V = num_slots, vocab_size
        t = lambda *shape, dtype, mirror=True: StagedTensor(shape, dtype, device, mirror)  # noqa: E731
        self.vocab_size = V
        self.eos_token_ids = sorted(eos_token_ids)
        self.default_processed = default_processed
        self.temperature = t(S, dtype=torch.float32)  # 0 = greedy
        self.top_k = t(S, dtype=torch.int32)  # 0 = off
        self.top_p = t(S, dtype=torch.float32)  # 1 = off
        self.min_p = t(S, dtype=torch.float32)  # 0 = off
        self.seed = t(S, dtype=torch.int64)
        self.repetition = t(S, dtype=torch.float32)  # 1 = off
        self.presence = t(S, dtype=torch.float32)  # 0 = off
        self.frequency = t(S, dtype=torch.float32)  # 0 = off
        self.num_prompt = t(S, dtype=torch.int32)  # slot -> prompt tokens (penalties, min_tokens, prompt logprobs)
        self.num_bias = t(S, dtype=torch.int32)
        self.bias_ids = t(S, MAX_LOGIT_BIAS, dtype=torch.int64, mirror=False)  # slot -> biased ids
        self.bias_values = t(S, MAX_LOGIT_BIAS, dtype=torch.float32, mirror=False)
        self.has_allowed = t(S, dtype=torch.bool)
        self.allowed = t(S, V, dtype=torch.bool, mirror=False)  # slot -> allowed-token mask
        self.min_tokens = t(S, dtype=torch.int32)
        self.num_stop_ids = t(S, dtype=torch.int32)
        self.stop_ids = t(S, MAX_STOP_TOKEN_IDS + len(self.eos_token_ids), dtype=torch.int64, mirror=False)
        self.num_logprobs = t(S, dtype=torch.int32)  # top-N per position, -1 = no logprobs
        self.num_lp_ids = t(S, dtype=torch.int32)  # > 0: logprob_token_ids instead of top-N
        self.lp_ids = t(S, MAX_LOGPROB_TOKEN_IDS, dtype=torch.int64, mirror=False)
        self.act = t(S, dtype=torch.int32)  # ACT_LOG_SOFTMAX or ACT_SIGMOID
        self.processed = t(S, dtype=torch.bool)  # logprobs of processed (True) or raw logits
        self.prompt_logprobs = t(S, dtype=torch.int32)  # -1 = none
        self.staged = [v for v in vars(self).values() if isinstance(v, StagedTensor)]
        # The sampling kernel's count of each row's finished vocabulary chunks (kernels/sampling.py), zero
        # between calls: kept here so that no call clears one of its own.
        self.sample_counts = torch.zeros(S, dtype=torch.int32, device=device)
        # Host only: whether a slot's request samples straight from its logits (sampler.plain_rows).
        self.plain = np.zeros(S, dtype=bool)
        # Host only: banned sequences and the token history they are checked against.
        self.bad_words: dict[int, list[list[int]]] = {}  # slot -> token sequences
        self.history: dict[int, list[int]] = {}  # slot -> prompt + outputs, for slots with bad words

    def add(self, slot: int, sp: SamplingParams, seed: int, token_ids: list[int], num_prompt: int) -> None:
        self.temperature.stage(slot, sp.temperature)
        self.top_k.stage(slot, max(sp.top_k, 0))
        self.top_p.stage(slot, sp.top_p)
        self.min_p.stage(slot, sp.min_p)
        seed &= _U64
        self.seed.stage(slot, seed - (1 << 64) if seed >= 1 << 63 else seed)  # as signed int64
        self.repetition.stage(slot, sp.repetition_penalty)
        self.presence.stage(slot, sp.presence_penalty)
        self.frequency.stage(slot, sp.frequency_penalty)
        self.num_prompt.stage(slot, num_prompt)
        bias = sp.logit_bias or {}
        self.num_bias.stage(slot, len(bias))
        if bias:
            self.bias_ids.stage(slot, list(bias))
            self.bias_values.stage(slot, list(bias.values()))
        self.has_allowed.stage(slot, sp.allowed_token_ids is not None)
        if sp.allowed_token_ids is not None:
            mask = np.zeros(self.vocab_size, dtype=bool)
            mask[sp.allowed_token_ids] = True
            self.allowed.stage(slot, mask)
        self.min_tokens.stage(slot, sp.min_tokens)
        if sp.min_tokens:
            stops = list(sp.stop_token_ids) + ([] if sp.ignore_eos else self.eos_token_ids)
            self.num_stop_ids.stage(slot, len(stops))
            self.stop_ids.stage(slot, stops)
        else:
            self.num_stop_ids.stage(slot, 0)
        # best_of > n ranks its samples by cumulative logprob: the sampled token's is needed.
        ranked = sp.num_samples > sp.n and not sp.use_beam_search
        self.num_logprobs.stage(slot, sp.num_logprobs if sp.num_logprobs is not None else 0 if ranked else -1)
        self.num_lp_ids.stage(slot, len(sp.logprob_token_ids or ()))
        if sp.logprob_token_ids:
            self.lp_ids.stage(slot, sp.logprob_token_ids)
        self.act.stage(slot, ACT_SIGMOID if sp.act_func == "sigmoid" else ACT_LOG_SOFTMAX)
        mode = sp.logprobs_mode
        self.processed.stage(slot, self.default_processed if mode is None else mode == "processed")
        self.prompt_logprobs.stage(slot, -1 if sp.prompt_logprobs is None else sp.prompt_logprobs)
        if sp.bad_words_token_ids:
            self.bad_words[slot] = sp.bad_words_token_ids
            self.history[slot] = list(token_ids)
        self.plain[slot] = not (
            sp.allowed_token_ids is not None or sp.bad_words_token_ids or sp.min_tokens or bias
            or sp.repetition_penalty != 1 or sp.presence_penalty != 0 or sp.frequency_penalty != 0
            or sp.top_k > 0 or sp.top_p < 1 or sp.min_p > 0 or ranked or sp.num_logprobs is not None
            or sp.prompt_logprobs is not None or sp.use_beam_search)

    def remove(self, slot: int) -> None:
        self.plain[slot] = False
        self.bad_words.pop(slot, None)
        self.history.pop(slot, None)

    def append(self, slot: int, token: int) -> None:
        """Record a sampled token in the history that bad words are checked against."""
        history = self.history.get(slot)
        if history is not None:
            history.append(token)

    def apply_staged(self) -> None:
        for tensor in self.staged:
            tensor.apply()
