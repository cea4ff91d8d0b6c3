"""A request's state inside the engine core."""
from __future__ import annotations

import enum
import time

from headrace.sampling_params import SamplingParams


def check_prompt(token_ids: list[int], max_model_len: int, vocab_size: int, name: str = "the prompt") -> None:
    """Raise ValueError, naming the prompt as `name`, for one no engine of
    these limits can serve: empty, too long to leave room for one generated
    token, or with ids outside the vocabulary."""
    if not token_ids:
        raise ValueError(f"{name} is empty")
    if len(token_ids) >= max_model_len:
        raise ValueError(f"{name} has {len(token_ids)} tokens, but max_model_len is {max_model_len} "
                         f"(at most {max_model_len - 1} prompt tokens, leaving room to generate one)")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")


def truncate_prompt(token_ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The prompt as params.truncate_prompt_tokens keeps it (vLLM's meaning): at most k tokens, the
    last k ("left") or the first ("right"); k = -1 is what max_model_len leaves beside max_tokens.
    Raises ValueError when k itself leaves no room for max_tokens."""
    k = params.truncate_prompt_tokens
    if k is None:
        return token_ids
    max_tokens = 1 if params.max_tokens is None else params.max_tokens
    room = max_model_len - max_tokens
    if room < 1:
        raise ValueError(f"truncate_prompt_tokens cannot apply: max_tokens={max_tokens} leaves no room for a "
                         f"prompt in max_model_len={max_model_len}")
    if k == -1:
        k = room
    elif k > room:
        raise ValueError(f"truncate_prompt_tokens ({k}) is more than max_model_len - max_tokens = {room}")
    if len(token_ids) <= k:
        return token_ids
    return list(token_ids[-k:] if params.truncation_side == "left" else token_ids[:k])


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # EOS or a stop token
    FINISHED_LENGTH = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """Tokens, progress and KV blocks of one sequence.

    num_computed_tokens counts the tokens whose KV is in the cache once the
    steps already queued on the device have run: the scheduler advances it
    when it schedules a step, not when the step reports. A step that computes
    a request's last expected token samples one more, which stays pending
    (num_pending) until that step's output is read back; the next step can
    already compute it, since the executor feeds sampled tokens on the
    device. A preempted request drops its blocks and pending tokens and
    recomputes everything, prompt and outputs alike, when readmitted.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int],
        seed: int,
        arrival_time: float | None = None,
        leader: Request | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.seed = seed  # the sampler's random source is keyed by (seed, position)
        self.leader = leader  # for the 2nd..nth samples of one prompt (n > 1): the first
        self.parent_id: str | None = None  # the id given to the engine, for samples of n > 1
        self.index = 0  # which sample of its request (or which beam)
        self.group = None  # the BeamGroup of a beam-search request's beams (core/beam.py)
        # prompt logprobs gathered over prefill chunks until the first output carries them
        self.prompt_logprobs: list = []
        self.num_prompt_logprobs = 0  # prompt positions gathered (a recompute after preemption skips them)
        self.prompt_logprobs_sent = False
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_pending = 0  # tokens sampled by queued steps, not yet read back
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.cumulative_logprob = 0.0  # kept for best_of > n, which ranks samples by it
        self.num_preemptions = 0
        self.block_ids: list[int] = []
        self.stop_reason: int | None = None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_expected(self) -> int:
        """Known tokens plus those queued steps will sample."""
        return len(self.all_token_ids) + self.num_pending

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
