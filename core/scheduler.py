"""Continuous batching with chunked prefill, prefix caching and preemption.

Each step spends a token budget (max_num_batched_tokens) on running
requests first, oldest first, then admits waiting ones while the budget,
max_num_seqs and the KV pool allow. A request may take only part of its
remaining prompt (chunked prefill). When a running request needs a block
and none is free, the newest running request is preempted: its blocks are
freed and it goes back to the front of the queue to be recomputed.

Scheduling runs ahead of the device: schedule() counts a step's tokens as
computed at once, and a step that reaches a request's last expected token
leaves one sampled token pending, so the next step can be scheduled (and
queued behind this one) before this one's tokens are read back. update()
takes a step's sampled tokens whenever they arrive. A request whose
pending tokens will finish it (max_tokens, max_model_len) is not scheduled
again.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from headrace.config import CacheConfig, SchedulerConfig
from headrace.core.kv_cache import KVCacheManager
from headrace.core.request import Request, RequestStatus
from headrace.sampling_params import SamplingParams
from headrace.step import CachedRequestData, NewRequestData, SchedulerOutput


@dataclass
class ScheduledStep(SchedulerOutput):
    """One step as the scheduler keeps it: what the executor runs, and, for
    update(), each batch row's request and whether it samples."""

    reqs: list[Request] = field(default_factory=list)  # batch row -> request
    samples: list[bool] = field(default_factory=list)  # batch row -> whether it samples a token
    num_preempted: int = 0


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
        # Live requests whose sampling reads their previous tokens on the host
        # (bad words): a step for them waits for the step before to report.
        self.host_token_ids: set[str] = set()
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.append(req)
        if req.sampling_params.bad_words_token_ids:
            self.host_token_ids.add(req.request_id)

    def schedule(self) -> ScheduledStep:
        out = ScheduledStep()
        budget = self.config.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if self._finishes_with_pending(req):
                i += 1
                continue
            n = min(req.num_expected - req.num_computed_tokens, budget)
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
            self._scheduled(out, req, n)
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
            self._scheduled(out, req, n)
            budget -= n

        out.finished_req_ids = self.take_left()
        return out

    def _scheduled(self, out: ScheduledStep, req: Request, n: int) -> None:
        """Count n tokens of req as computed by this step, and its sample as pending."""
        # Blocks that earlier steps compute are shared from now on; this
        # step's own blocks only from the next schedule, so a prefix hit never
        # reads a block that its step is still writing.
        self.kv.cache_computed_blocks(req)
        out.num_scheduled_tokens[req.request_id] = n
        out.reqs.append(req)
        req.num_computed_tokens += n
        samples = req.num_computed_tokens == req.num_expected
        out.samples.append(samples)
        if samples:
            req.num_pending += 1

    def _finishes_with_pending(self, req: Request) -> bool:
        """Whether the tokens queued steps sample will finish req by length."""
        if not req.num_pending:
            return False
        max_tokens = req.sampling_params.max_tokens
        return (max_tokens is not None and len(req.output_token_ids) + req.num_pending >= max_tokens) \
            or req.num_expected >= self.config.max_model_len

    def take_left(self) -> set[str]:
        """Ids of requests that left the executor (finished, aborted,
        preempted) since the last call: their slots are to be freed."""
        left, self._left = self._left, set()
        return left

    def _waits_for_leader(self, req: Request) -> bool:
        """A sibling of a parallel-sampling request (n > 1) waits until the
        first sibling's prompt blocks are in the prefix cache, then shares
        them instead of computing them again."""
        leader = req.leader
        if leader is None or not self.kv.enable_prefix_caching or leader.request_id not in self.requests:
            return False
        shareable = (leader.num_prompt_tokens - 1) // self.kv.block_size  # see find_cached_prefix
        return self.kv.num_registered_blocks(leader) < shareable

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_pending = 0  # what queued steps sample for it is dropped
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self._left.add(req.request_id)

    def update(self, out: ScheduledStep, sampled_token_ids: list[int]) -> list[RequestUpdate]:
        """Take one step's sampled tokens: sampled_token_ids[row] for batch
        row `row`; rows that did not sample (prefill chunks) are ignored.

        Steps report in the order they were scheduled, possibly after later
        steps were scheduled. A row whose request was aborted or preempted
        since its step was scheduled is dropped: its status is no longer
        RUNNING (a preempted request is readmitted only by a schedule made
        after this step reported).
        """
        updates = []
        now = time.time()
        for row, req in enumerate(out.reqs):
            if not out.samples[row] or req.status != RequestStatus.RUNNING:
                continue
            token = sampled_token_ids[row]
            req.num_pending -= 1
            req.append_token(token)
            self.kv.cache_computed_blocks(req)
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
        self.host_token_ids.discard(req.request_id)
