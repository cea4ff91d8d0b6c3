"""What the core hands the executor each step: the scheduler's output as the
executor reads it. The core builds these; the executor (in this process or a
tensor-parallel worker's) runs them. Neither side's internals live here."""
from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass
class CachedRequestData:
    """A request already in a slot: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


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

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())
