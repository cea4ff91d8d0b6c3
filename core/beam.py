"""Beam search in the engine: one request's beams as a group the scheduler runs together.

A group of width W holds W beams, each a Request in its own executor slot
and its own batch row. Beam 0 computes the prompt; when its last prompt
chunk is scheduled the other beams join, sharing the prompt's full KV blocks
(one reference each) and holding one block of their own for the partial
last one. Every step after that computes one token for each of the W beams.

On the device, the step that computes the beams' last tokens picks the K
best continuations of the group by cumulative score (K = max(2, 1 + number
of stop ids) * W, as transformers), and from them the W best that do not
stop: the next beams, a plan (parent, token, score) per beam. The group's
next step begins by applying the plan on the device (each beam takes its
parent's tokens and block table, and a copy of its parent's partial last
block) before the forward pass; so steps queue ahead of the host as for
any request. The host reads the same K candidates a step later and derives
the same plan from them (update()), in order to follow each beam's tokens
and blocks, collect finished hypotheses and decide when the search ends.

The rules are transformers' beam search (generate with num_beams=W,
do_sample=False): scores are sums of log_softmax values; a candidate among
the top W that ends (EOS, a stop token, a stop string, the length limit)
becomes a hypothesis scored score / length ** length_penalty, of which the
W best are kept; early_stopping True ends the search once W hypotheses are
kept, False once the best running beam cannot beat the worst kept
hypothesis at its current length, "never" (with length_penalty > 0) at the
longest length it may reach.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from headrace.core.request import Request
from headrace.sampling_params import SamplingParams


@dataclass
class Beam:
    """A sequence as an output shows it: a running beam or a finished one."""

    token_ids: list[int]  # generated tokens
    cumulative: float  # sum of its tokens' scores
    logprobs: list | None  # per generated position, as the executor packed it
    finish_reason: str | None  # "stop" or "length" once finished
    stop_reason: int | str | None


@dataclass
class Hypothesis(Beam):
    """A finished beam."""

    score: float  # cumulative / length ** length_penalty: what ranks hypotheses


class BeamGroup:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sp: SamplingParams,
                 eos_token_ids: frozenset[int], arrival_time: float, max_model_len: int, tokenizer=None) -> None:
        self.request_id = request_id
        self.params = sp
        self.width = sp.num_samples
        self.beams = []
        for i in range(self.width):
            beam = Request(f"{request_id}#beam{i}", prompt_token_ids, sp, eos_token_ids, 0, arrival_time)
            beam.parent_id, beam.index, beam.group = request_id, i, self
            self.beams.append(beam)
        self.stop_ids = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else eos_token_ids)
        self.num_candidates = max(2, 1 + len(self.stop_ids)) * self.width
        self.max_generated = min(sp.max_tokens, max_model_len - len(prompt_token_ids))
        self.scores = [0.0] * self.width  # running beam -> cumulative score
        self.logprobs: list[list] | None = [[] for _ in range(self.width)] if sp.num_logprobs is not None else None
        self.finished: list[Hypothesis] = []  # the best W, best first
        self.improvable = True  # transformers' early-stop heuristic, not yet satisfied
        self.num_generated = 0  # tokens each running beam has
        self.expanded = False  # beams 1.. hold slots and blocks
        self.tails: list[int] = []  # blocks reserved for beams 1.. until they join
        self.joining: set[str] = set()  # beams that enter the executor at their next step
        self.fork_at: int | None = None  # tokens before the selected ones, while a plan waits to be applied
        self.done = False
        # Stop strings: candidates are decoded here, and the plan the host
        # derives (which then may differ from the device's) is the one applied.
        self.tokenizer = tokenizer if sp.stop else None
        self.texts = [""] * self.width  # running beam -> its decoded text
        self.plan: list[tuple[int, int, float]] | None = None  # (parent, token, score) per new beam

    def _stop_strings(self, parents: list[int], tokens: list[int]) -> tuple[list[str | None], list[str]] | None:
        """Per candidate, the first stop string its text gains with its token
        (or None), and its text; None without stop strings."""
        if self.tokenizer is None:
            return None
        sp, found, texts = self.params, [], []
        for p, t in zip(parents, tokens):
            before = self.texts[p]
            text = self.tokenizer.decode(self.beams[p].output_token_ids + [t],
                                         skip_special_tokens=sp.skip_special_tokens)
            hits = [(i, s) for s in sp.stop if (i := text.find(s, max(0, len(before) - len(s) + 1))) >= 0]
            found.append(min(hits)[1] if hits else None)
            texts.append(text)
        return found, texts

    @property
    def home(self) -> Request:
        """Beam 0: it computes the prompt, and its slot keys the group's plan on the device."""
        return self.beams[0]

    def num_tails(self, block_size: int) -> int:
        """Blocks the other beams need of their own when they join: copies of the prompt's partial last block."""
        return self.width - 1 if self.home.num_prompt_tokens % block_size else 0

    def stop_reason_of(self, token: int, finish_by_length: bool) -> tuple[bool, int | None]:
        if token in self.stop_ids:
            return True, token if token in self.params.stop_token_ids else None
        return finish_by_length, None

    def select(self, scores: np.ndarray, parents: np.ndarray, tokens: np.ndarray, lp_rows=None) -> list[int]:
        """Take one step's K candidates (best first) and move every beam on.

        Returns, per new beam, the old beam it continues (its parent).
        lp_rows(k): candidate k's logprobs for this position. Sets self.done
        when the search is over.
        """
        sp, width = self.params, self.width
        length = self.num_generated + 1
        by_length = length >= self.max_generated
        scores, parents, tokens = scores.tolist(), parents.tolist(), tokens.tolist()
        stop_strings, texts = self._stop_strings(parents, tokens) or (None, None)
        if by_length or stop_strings is not None or any(t in self.stop_ids for t in tokens):
            ends = []
            for k in range(self.num_candidates):
                ended, reason = self.stop_reason_of(tokens[k], by_length)
                if stop_strings is not None and stop_strings[k] is not None:
                    ended, reason = True, stop_strings[k]
                ends.append((ended, reason))
        else:  # most steps: no candidate ends
            ends = [(False, None)] * self.num_candidates
        running = [k for k in range(self.num_candidates) if not ends[k][0]][:width]
        full = len(self.finished) == width
        if self.improvable and not (full and sp.early_stopping is True):
            new = []
            for k in range(width):
                ended, reason = ends[k]
                if ended:
                    p = parents[k]
                    lps = self.logprobs[p] + [lp_rows(k)] if self.logprobs is not None else None
                    finish = "stop" if tokens[k] in self.stop_ids or isinstance(reason, str) else "length"
                    new.append(Hypothesis(self.beams[p].output_token_ids + [tokens[k]], scores[k], lps, finish,
                                          reason, scores[k] / length ** sp.length_penalty))
            if new:  # stable: kept hypotheses first, then the new ones by rank
                self.finished = sorted(self.finished + new, key=lambda h: -h.score)[:width]
        if len(running) < width:
            self.done = True  # every candidate ended: nothing to continue
            self.num_generated = length
            return []
        chosen = [parents[k] for k in running]
        if self.tokenizer is not None:
            self.plan = [(parents[k], tokens[k], scores[k]) for k in running]
            self.texts = [texts[k] for k in running]
        self.scores = [scores[k] for k in running]
        if self.logprobs is not None:
            self.logprobs = [self.logprobs[parents[k]] + [lp_rows(k)] for k in running]
        olds = [(b.output_token_ids, b.all_token_ids) for b in self.beams]
        for beam, k in zip(self.beams, running):
            out, every = olds[parents[k]]
            beam.output_token_ids = out + [tokens[k]]
            beam.all_token_ids = every + [tokens[k]]
        self.num_generated = length
        self._check_done()
        return chosen

    def _check_done(self) -> None:
        sp, width = self.params, self.width
        if sp.early_stopping == "never" and sp.length_penalty > 0.0:
            best_length = self.max_generated
        else:
            best_length = self.num_generated
        best_possible = self.scores[0] / best_length ** sp.length_penalty
        worst_kept = self.finished[-1].score if len(self.finished) == width else -1.0e9
        self.improvable = self.improvable and best_possible > worst_kept
        full = len(self.finished) == width
        if not self.improvable or (full and sp.early_stopping is True) or self.num_generated >= self.max_generated:
            self.done = True

    def best(self, n: int, final: bool) -> list[Beam]:
        """The n best sequences now: kept hypotheses and, while the search
        runs (or was cut short), running beams ranked at their current length."""
        ranked: list[tuple[float, Beam]] = [(h.score, h) for h in self.finished]
        if not final or len(ranked) < n:
            length = max(self.num_generated, 1)
            for j, beam in enumerate(self.beams):
                if self.num_generated == 0 and j:
                    break  # before the first selection the beams are one
                lps = self.logprobs[j] if self.logprobs is not None else None
                ranked.append((self.scores[j] / length ** self.params.length_penalty,
                               Beam(beam.output_token_ids, self.scores[j], lps, None, None)))
        ranked.sort(key=lambda x: -x[0])
        return [b for _, b in ranked[:n]]
