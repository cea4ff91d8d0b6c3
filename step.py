"""What the core hands the executor each step: the scheduler's output as the
executor reads it. The core builds these; the executor (in this process or a
tensor-parallel worker's) runs them. Neither side's internals live here."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from headrace.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request entering the executor: it takes a slot and stages these."""

    req_id: str
    token_ids: list[int]  # every known token: prompt, plus outputs if it was preempted
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    seed: int
    beam_score: float = 0.0  # a beam's cumulative score, which its next selection adds to


@dataclass
class CachedRequestData:
    """A request already in a slot: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class BeamSelect:
    """A beam group whose rows in this step sample: the device picks the
    group's next beams from them (executor/beam.py)."""

    home: str  # beam 0's request id: its slot keys the group's plan
    beam_ids: list[str]  # the group's rows in this step, in beam order (beam 0 alone at the first selection)
    width: int
    num_candidates: int  # K, the best continuations reported
    stop_ids: list[int]  # tokens that end a beam


@dataclass
class BeamFork:
    """A beam group applying its last plan before this step computes: beam j
    takes its parent's first num_tokens tokens and their KV (shared blocks,
    and a copy of a partial last block), then the selected token."""

    home: str
    beam_ids: list[str]  # every beam, in beam order
    num_tokens: int
    # The plan the host made (stop strings), replacing the device's: (parent, token, score) per beam.
    plan: list[tuple[int, int, float]] | None = None


@dataclass
class SchedulerOutput:
    """One step: the requests that enter, continue and leave the executor, and
    how many tokens each batch row computes."""

    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens; batch order
    # Requests that left the executor since the last step (finished, aborted,
    # preempted): their slots are freed before new requests take slots.
    finished_req_ids: set[str] = field(default_factory=set)
    beam_forks: list[BeamFork] = field(default_factory=list)
    beam_selects: list[BeamSelect] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class BeamCandidates:
    """One step's beam candidates as the host reads them: per group of the
    step's beam_selects, its K best continuations, best first."""

    def __init__(self, scores: np.ndarray, parents: np.ndarray, tokens: np.ndarray, logprobs=None) -> None:
        self.scores = scores  # [G, Kmax] float32 cumulative scores
        self.parents = parents  # [G, Kmax] int32: the beam each continues
        self.tokens = tokens  # [G, Kmax] int32
        self.logprobs = logprobs  # SampledLogprobs of [G * Kmax] rows, or None

    def candidates(self, g: int, k: int, num_logprob_cols: int | None):
        """Group g's first k candidates: (scores, parents, tokens, logprob
        rows: candidate -> its packed logprobs, or None)."""
        rows = None
        if num_logprob_cols is not None and self.logprobs is not None:
            base = g * self.scores.shape[1]
            rows = lambda c: self.logprobs.wire(base + c, num_logprob_cols)  # noqa: E731
        return self.scores[g, :k], self.parents[g, :k], self.tokens[g, :k], rows
