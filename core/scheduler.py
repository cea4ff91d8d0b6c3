"""Continuous batching with chunked prefill, prefix caching and preemption.

Each step spends a token budget (max_num_batched_tokens) on running
requests first, oldest first, then admits waiting ones while the budget,
max_num_seqs and the KV pool allow. A request may take only part of its
remaining prompt (chunked prefill). When a running request needs a block
and none is free, the newest running request is preempted: its blocks are
freed and it goes back to the front of the queue to be recomputed.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from headrace.core.config import CacheConfig, SchedulerConfig
from headrace.core.kv_cache import KVCacheManager
from headrace.core.request import Request, RequestStatus
from headrace.core.sampling_params import SamplingParams


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
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens; batch order
    # Requests that left the executor since the last step (finished, aborted,
    # preempted): their slots are freed before new requests take slots.
    finished_req_ids: set[str] = field(default_factory=set)
    num_preempted: int = 0

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass
class RequestUpdate:
    """What one step did for one request."""

    req: Request
    new_token_ids: list[int]
    row: int  # batch row of the sampled token, for its logprobs
    finish_reason: str | None = None
    stop_reason: int | None = None


class Scheduler:
    def __init__(self, sched: SchedulerConfig, cache: CacheConfig) -> None:
        self.config = sched
        self.kv = KVCacheManager(cache.num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._left: set[str] = set()  # request ids to report in the next finished_req_ids
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            new_blocks = self.kv.allocate(req, n)
            while new_blocks is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                out.num_preempted += 1
                if victim is req:
                    break
                new_blocks = self.kv.allocate(req, n)
            if new_blocks is None:
                break
            out.cached_reqs.append(CachedRequestData(req.request_id, new_blocks, req.num_computed_tokens))
            out.num_scheduled_tokens[req.request_id] = n
            budget -= n
            i += 1

        # A step that had to preempt admits nothing: the pool is full.
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs \
                and not preempted:
            req = self.waiting[i]
            if self._waits_for_leader(req):
                i += 1
                continue
            cached = self.kv.find_cached_prefix(req)
            num_computed = len(cached) * self.kv.block_size
            n = min(req.num_tokens - num_computed, budget)
            blocks = self.kv.allocate(req, n, cached)
            if blocks is None:
                break
            del self.waiting[i]
            if req.status == RequestStatus.WAITING:
                req.num_cached_tokens = num_computed
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_computed
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            self.running.append(req)
            out.new_reqs.append(
                NewRequestData(req.request_id, list(req.all_token_ids), req.num_prompt_tokens, list(req.block_ids),
                               num_computed, req.sampling_params, req.seed)
            )
            out.num_scheduled_tokens[req.request_id] = n
            budget -= n

        out.finished_req_ids = self.take_left()
        return out

    def take_left(self) -> set[str]:
        """Ids of requests that left the executor (finished, aborted,
        preempted) since the last call: their slots are to be freed."""
        left, self._left = self._left, set()
        return left

    def _waits_for_leader(self, req: Request) -> bool:
        """A sibling of a parallel-sampling request (n > 1) waits until the
        first sibling has computed the prompt, then shares its full prompt
        blocks through the prefix cache instead of computing them again."""
        leader = req.leader
        return (leader is not None and self.kv.enable_prefix_caching and leader.request_id in self.requests
                and leader.num_computed_tokens < leader.num_prompt_tokens)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self._left.add(req.request_id)

    def update(self, out: SchedulerOutput, sampled_token_ids: list[int]) -> list[RequestUpdate]:
        """Advance the scheduled requests by one step's results.

        sampled_token_ids[row] is the token sampled for batch row `row`;
        rows whose request has not yet computed all its known tokens (a
        prefill chunk) produced no token.
        """
        updates = []
        now = time.time()
        for row, (req_id, n) in enumerate(out.num_scheduled_tokens.items()):
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            req.num_computed_tokens += n
            self.kv.cache_computed_blocks(req)
            if req.num_computed_tokens < req.num_tokens:
                continue
            token = sampled_token_ids[row]
            req.append_token(token)
            if req.first_token_time is None:
                req.first_token_time = now
            status = self._check_stop(req, token)
            update = RequestUpdate(req, [token], row)
            if status is not None:
                self._finish(req, status)
                update.finish_reason = status.finish_reason
                update.stop_reason = req.stop_reason
            updates.append(update)
        return updates

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        if not sp.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in sp.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if sp.max_tokens is not None and len(req.output_token_ids) >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def abort(self, req_ids) -> list[str]:
        """Finish these requests as aborted; returns the ids that were live."""
        # dict.fromkeys: an id repeated in one call is aborted once, not
        # looked up again after _finish has removed it (a KeyError).
        aborted = [rid for rid in dict.fromkeys(req_ids) if rid in self.requests]
        for req_id in aborted:
            self._finish(self.requests[req_id], RequestStatus.FINISHED_ABORTED)
        return aborted

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self._left.add(req.request_id)  # it holds a slot in the executor
        else:
            self.waiting.remove(req)
        req.status = status
        req.finished_time = time.time()
        self.kv.free(req)
        del self.requests[req.request_id]
