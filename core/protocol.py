"""Typed messages between the frontend and the engine core."""
from __future__ import annotations

import msgspec

from headrace.core.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float


class PositionLogprobs(msgspec.Struct, array_like=True):
    """Raw logprobs at one generated position: the sampled token first, then the top-N."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


class EngineCoreOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What one step did for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
