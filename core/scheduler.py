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

A beam-search request is a group of beams (core/beam.py) scheduled,
preempted and finished as one unit: beam 0 alone while it computes the
prompt, then every beam one token a step, each step selecting the next
beams; a preempted group frees every block and comes back whole.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from headrace.config import CacheConfig, SchedulerConfig
from headrace.core.beam import BeamGroup
from headrace.core.kv_cache import KVCacheManager
from headrace.core.request import Request, RequestStatus
from headrace.step import BeamFork, BeamSelect, CachedRequestData, NewRequestData, SchedulerOutput


@dataclass
class ScheduledStep(SchedulerOutput):
    """One step as the scheduler keeps it: what the executor runs, and, for
    update(), each batch row's request and whether it samples."""

    reqs: list[Request] = field(default_factory=list)  # batch row -> request
    samples: list[bool] = field(default_factory=list)  # batch row -> whether it samples a token
    num_preempted: int = 0
    groups: list[BeamGroup] = field(default_factory=list)  # beam_selects' groups, in order
    fork_lens: list[int] = field(default_factory=list)  # group -> tokens before its selected ones


@dataclass
class RequestUpdate:
    """What one step did for one request."""

    req: Request
    new_token_ids: list[int]
    row: int  # batch row of the sampled token, for its logprobs
    finish_reason: str | None = None
    stop_reason: int | None = None
    group: BeamGroup | None = None  # a beam group's step: its beams moved on


def _unit(req: Request) -> list[Request]:
    """What is scheduled, preempted and finished together: a beam group's beams, or req."""
    return req.group.beams if req.group is not None else [req]


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
        """Queue a request; for a beam group, its beam 0 (the group's beams all come in)."""
        for r in _unit(req):
            if r.request_id in self.requests:
                raise ValueError(f"request id {r.request_id!r} is already in use")
        for r in _unit(req):
            self.requests[r.request_id] = r
        self.waiting.append(req)
        if req.group is not None and req.group.tokenizer is not None:
            self.host_token_ids.add(req.request_id)  # its plans are made on the host: a step at a time
        if req.sampling_params.bad_words_token_ids:
            self.host_token_ids.add(req.request_id)

    def schedule(self) -> ScheduledStep:
        out = ScheduledStep()
        budget = self.config.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.group is not None:
                used = self._schedule_group(out, req.group, budget) if req is req.group.home else 0
                if used is None:  # the group preempted itself
                    preempted = True
                    break
                preempted |= out.num_preempted > 0
                budget -= used
                i += 1
                continue
            if self._finishes_with_pending(req):
                i += 1
                continue
            n = min(req.num_expected - req.num_computed_tokens, budget)
            new_blocks = self._allocate(out, req, n)
            if new_blocks is None:
                preempted = True
                break
            preempted |= out.num_preempted > 0
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
            if req.group is not None:
                if len(self.running) + req.group.width > self.config.max_num_seqs or budget < req.group.width:
                    break  # in order: a group is not overtaken
                if req.group.expanded:  # recomputing after preemption: every beam, in the running loop
                    del self.waiting[i]
                    for beam in req.group.beams:
                        beam.status = RequestStatus.RUNNING
                    self.running.extend(req.group.beams)
                    used = self._schedule_group(out, req.group, budget)
                    if used is None:
                        break
                    budget -= used
                    continue
            cached = self.kv.find_cached_prefix(req)
            num_computed = len(cached) * self.kv.block_size
            n = min(req.num_tokens - num_computed, budget)
            # A group's other beams will each need a block of their own for
            # the prompt's partial last block: reserved now, so that the
            # group never stalls half-expanded.
            tails = req.group.num_tails(self.kv.block_size) if req.group is not None else 0
            blocks = self.kv.allocate(req, n, cached, reserve=tails)
            if blocks is None:
                break
            if tails:
                req.group.tails = self.kv.pool.allocate(tails)
            del self.waiting[i]
            if req.status == RequestStatus.WAITING:
                req.num_cached_tokens = num_computed
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_computed
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            self.running.extend(_unit(req))  # a group's other beams join when beam 0 has its prompt
            for beam in _unit(req)[1:]:
                beam.status = RequestStatus.RUNNING
            out.new_reqs.append(self._new_data(req))
            self._scheduled(out, req, n)
            if req.group is not None and out.samples[-1]:
                self._expand(out, req.group)
            budget -= n

        out.finished_req_ids = self.take_left()
        return out

    @staticmethod
    def _new_data(req: Request, token_ids: list[int] | None = None) -> NewRequestData:
        score = req.group.scores[req.index] if req.group is not None else 0.0
        return NewRequestData(req.request_id, list(req.all_token_ids) if token_ids is None else token_ids,
                              req.num_prompt_tokens, list(req.block_ids), req.num_computed_tokens,
                              req.sampling_params, req.seed, score)

    def _allocate(self, out: ScheduledStep, req: Request, n: int, make=None):
        """kv.allocate(req, n) (or make()), preempting the newest running
        requests while the pool is short; None if req itself was preempted."""
        while (blocks := make() if make is not None else self.kv.allocate(req, n)) is None:
            victim = self.running[-1]
            self._preempt(victim)
            out.num_preempted += 1
            if victim in _unit(req):
                return None
        return blocks

    # ---- beam groups (core/beam.py) ----

    def _schedule_group(self, out: ScheduledStep, group: BeamGroup, budget: int) -> int | None:
        """Schedule a running group's beams, all or none; returns the tokens
        used, or None if the group had to be preempted (and then nothing of
        it is in the step)."""
        mark = (len(out.new_reqs), len(out.cached_reqs), len(out.reqs), len(out.beam_forks))
        used = self._schedule_beams(out, group, budget)
        if used is None:
            new, cached, rows, forks = mark
            for req in out.reqs[rows:]:
                del out.num_scheduled_tokens[req.request_id]
            del out.new_reqs[new:], out.cached_reqs[cached:], out.reqs[rows:], out.samples[rows:]
            del out.beam_forks[forks:]
            if out.groups and out.groups[-1] is group:
                del out.groups[-1], out.fork_lens[-1], out.beam_selects[-1]
        return used

    def _schedule_beams(self, out: ScheduledStep, group: BeamGroup, budget: int) -> int | None:
        home, beams = group.home, group.beams
        if not group.expanded:  # beam 0 computes the prompt
            if home.num_pending:
                return 0
            n = min(home.num_expected - home.num_computed_tokens, budget)
            blocks = self._allocate(out, home, n)
            if blocks is None:
                return None
            out.cached_reqs.append(CachedRequestData(home.request_id, blocks, home.num_computed_tokens))
            self._scheduled(out, home, n)
            if out.samples[-1]:
                self._expand(out, group)
            return n
        # After preemption each beam recomputes all but its last token; then
        # the beams take steps together, each computing one token, and each
        # such step selects the next beams.
        recompute = any(b.num_computed_tokens < b.num_tokens - 1 for b in beams)
        if not recompute and (budget < len(beams) or group.num_generated + home.num_pending >= group.max_generated):
            return 0  # no room for every beam this step, or the queued steps end the search by length
        if not recompute and not group.joining and home.num_computed_tokens < len(home.block_ids) * self.kv.block_size:
            self._decode_group(out, group)  # the common step: every beam has room in its blocks
            return len(beams)
        used = 0
        for beam in beams:
            target = beam.num_tokens - 1 if recompute else beam.num_expected
            n = min(target - beam.num_computed_tokens, budget - used)
            if n <= 0:
                continue
            if beam.request_id in group.joining:
                group.joining.discard(beam.request_id)
                blocks = self._allocate(out, beam, n)
                if blocks is None:
                    return None
                out.new_reqs.append(self._new_data(beam, beam.all_token_ids + [0]))
            elif not beam.block_ids:  # readmitted after preemption: recomputes, from its cached prefix on
                cached = self.kv.find_cached_prefix(beam)
                beam.num_computed_tokens = len(cached) * self.kv.block_size
                n = min(target - beam.num_computed_tokens, budget - used)
                if self._allocate(out, beam, n, lambda: self.kv.allocate(beam, n, cached)) is None:
                    return None
                out.new_reqs.append(self._new_data(beam))
                if not n:
                    continue
            else:
                blocks = self._allocate(out, beam, n)
                if blocks is None:
                    return None
                out.cached_reqs.append(CachedRequestData(beam.request_id, blocks, beam.num_computed_tokens))
            self._scheduled(out, beam, n)
            used += n
        if not recompute:
            self._forks(out, group)
            self._selects(out, group, beams)
        return used

    def _decode_group(self, out: ScheduledStep, group: BeamGroup) -> None:
        """One token for every beam, none needing a block (they all have the
        home's length and block count). The executor's slots already know
        each beam's blocks and count: no CachedRequestData."""
        beams = group.beams
        self._forks(out, group)
        for beam in beams:
            beam.num_computed_tokens += 1
            beam.num_pending += 1
            out.num_scheduled_tokens[beam.request_id] = 1
        out.reqs.extend(beams)
        out.samples.extend([True] * len(beams))
        self._selects(out, group, beams)

    @staticmethod
    def _forks(out: ScheduledStep, group: BeamGroup) -> None:
        """The group's last selection, not applied yet, is applied before this step computes."""
        if group.fork_at is not None:
            out.beam_forks.append(BeamFork(group.home.request_id, [b.request_id for b in group.beams],
                                           group.fork_at, group.plan))
            group.plan = None

    def _selects(self, out: ScheduledStep, group: BeamGroup, rows: list[Request]) -> None:
        """The step just scheduled computes these beams' last tokens: it selects the group's next beams."""
        group.fork_at = group.home.num_computed_tokens
        out.groups.append(group)
        out.fork_lens.append(group.fork_at)
        out.beam_selects.append(BeamSelect(group.home.request_id, [b.request_id for b in rows], group.width,
                                           group.num_candidates, sorted(group.stop_ids)))

    def _expand(self, out: ScheduledStep, group: BeamGroup) -> None:
        """Beam 0's last prompt chunk is scheduled: the other beams join,
        sharing the prompt's full blocks and taking the reserved blocks for
        their own copies of the partial last one."""
        home = group.home
        full = home.num_computed_tokens // self.kv.block_size
        for beam, tail in zip(group.beams[1:], group.tails or [None] * (group.width - 1)):
            self.kv.share(beam, home.block_ids[:full] + ([tail] if tail is not None else []), num_shared=full)
            beam.num_computed_tokens = home.num_computed_tokens
            beam.num_pending = 1
            group.joining.add(beam.request_id)
        group.tails = []
        group.expanded = True
        self._selects(out, group, [home])

    def _scheduled(self, out: ScheduledStep, req: Request, n: int) -> None:
        """Count n tokens of req as computed by this step, and its sample as pending."""
        # Blocks that earlier steps compute are shared from now on; this
        # step's own blocks only from the next schedule, so a prefix hit never
        # reads a block that its step is still writing. (Beams register their
        # prompt's blocks only: the blocks past it change hands as beams fork.)
        if req.group is None or not req.output_token_ids:
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
        """Send req (a beam group: all its beams) back to the front of the queue, freeing its blocks."""
        for r in _unit(req):
            self.kv.free(r)
            if r in self.running:
                self.running.remove(r)
            r.status = RequestStatus.PREEMPTED
            r.num_computed_tokens = 0
            r.num_pending = 0  # what queued steps sample for it is dropped
            r.num_preemptions += 1
            self._left.add(r.request_id)
        group = req.group
        if group is not None:
            req = group.home
            self.kv.pool.free(group.tails)
            group.tails = []
            group.fork_at = group.plan = None  # the plan of a queued step is dropped with its tokens
            group.joining.clear()
            if not group.num_generated:  # no beam has a token of its own yet: start again from beam 0
                group.expanded = False
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, out: ScheduledStep, sampled_token_ids: list[int], beams=None) -> list[RequestUpdate]:
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
        for g, group in enumerate(out.groups):
            if group.home.status == RequestStatus.RUNNING:
                sp = group.params
                cols = 1 + sp.num_logprobs if sp.num_logprobs is not None else None
                candidates = beams.candidates(g, group.num_candidates, cols)
                updates.append(self._update_group(group, out.fork_lens[g], candidates, now))
        for row, req in enumerate(out.reqs):
            if not out.samples[row] or req.status != RequestStatus.RUNNING or req.group is not None:
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

    def _update_group(self, group: BeamGroup, num_tokens: int, candidates, now: float) -> RequestUpdate:
        """Move a group's beams on by one step's candidates (BeamGroup.select)."""
        parents = group.select(*candidates)
        if parents:
            self.kv.fork(group.beams, parents, num_tokens)
        for beam in group.beams:
            beam.num_pending -= 1
        home = group.home
        if home.first_token_time is None:
            home.first_token_time = now
        update = RequestUpdate(home, [], -1, group=group)
        if group.done:
            self._finish(home, RequestStatus.FINISHED_STOPPED)
            update.finish_reason = "stop"
        return update

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
            if req_id in self.requests:  # not finished with its group already
                self._finish(self.requests[req_id], RequestStatus.FINISHED_ABORTED)
        return aborted

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """Finish req (a beam group: all its beams), freeing its blocks and slots."""
        now = time.time()
        for r in _unit(req):
            if r.status == RequestStatus.RUNNING:
                self.running.remove(r)
                self._left.add(r.request_id)  # it holds a slot in the executor
            elif r in self.waiting:
                self.waiting.remove(r)
            r.status = status
            r.finished_time = now
            self.kv.free(r)
            del self.requests[r.request_id]
            self.host_token_ids.discard(r.request_id)
        if req.group is not None:
            self.kv.pool.free(req.group.tails)
            req.group.tails = []
            req.group.done = True
