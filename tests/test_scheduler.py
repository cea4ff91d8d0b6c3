"""The scheduler and KV block manager, driven by a fake executor (no model, no torch).

The fake executor mirrors what the real one does with a SchedulerOutput: it
keeps each admitted request's tokens, block table and progress from the
new/cached request data alone, writes every computed token into a fake KV
pool (block id -> token per offset) and, before each step, checks that every
position the request reads holds the right token. So a wrong block table, a
stale prefix-cache hit or an overwritten shared block shows up as wrong
"KV contents", the way it would corrupt a real model's attention.

Like the real one, the fake executor appends each sampled token to its own
copy of the request's tokens at once, so with overlap (the Driver schedules
step N+1 before it hands step N's tokens to the scheduler) it runs ahead of
the scheduler's known tokens by the pending ones.
"""
from __future__ import annotations

import random
from collections import Counter, defaultdict, deque

import pytest

from headrace.config import CacheConfig, SchedulerConfig
from headrace.core.kv_cache import hash_block
from headrace.core.request import Request, RequestStatus
from headrace.core.scheduler import Scheduler
from headrace.sampling_params import SamplingParams

EOS = 0


def default_token(req_id: str, pos: int) -> int:
    """The token the fake model samples at position pos: deterministic, never EOS."""
    return 100 + pos % 13


def make_request(req_id, prompt, max_tokens=16, eos=(EOS,), **kwargs) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, **kwargs)
    return Request(req_id, list(prompt), sp, eos_token_ids=frozenset(eos), seed=0)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class FakeExecutor:
    """Mirrors the scheduler's decisions from SchedulerOutput only, like the model runner."""

    def __init__(self, sched: Scheduler, choose=default_token) -> None:
        self.sched = sched
        self.bs = sched.kv.block_size
        self.kv = [[None] * self.bs for _ in range(sched.kv.pool.num_blocks)]  # block -> token per offset
        self.slots: dict[str, dict] = {}  # request id -> tokens, blocks, computed
        self.choose = choose

    def remove(self, req_ids) -> None:
        for rid in req_ids:
            assert rid in self.slots, f"{rid} left the executor without having entered it"
            del self.slots[rid]

    def execute(self, out) -> list[int]:
        self.remove(out.finished_req_ids)
        for new in out.new_reqs:
            assert new.req_id not in self.slots, f"{new.req_id} admitted twice without leaving"
            self.slots[new.req_id] = dict(tokens=list(new.token_ids), blocks=list(new.block_ids),
                                          computed=new.num_computed_tokens)
        assert len(self.slots) <= self.sched.config.max_num_seqs
        for c in out.cached_reqs:
            st = self.slots[c.req_id]
            assert st["computed"] == c.num_computed_tokens
            st["blocks"].extend(c.new_block_ids)
        sampled = []
        for row, (rid, n) in enumerate(out.num_scheduled_tokens.items()):
            st = self.slots[rid]
            tokens, blocks, computed = st["tokens"], st["blocks"], st["computed"]
            req = self.sched.requests[rid]
            assert tokens[: req.num_tokens] == req.all_token_ids  # then the pending samples
            assert len(tokens) + (computed + n == len(tokens)) == req.num_expected
            assert blocks == req.block_ids
            assert 0 < n and computed + n <= len(tokens)
            for p in range(computed):  # the KV this step attends to
                assert self.kv[blocks[p // self.bs]][p % self.bs] == tokens[p], f"{rid}: stale KV at {p}"
            for p in range(computed, computed + n):
                b = blocks[p // self.bs]
                assert self.sched.kv.pool.ref_counts[b] == 1, f"{rid} writes into shared block {b}"
                self.kv[b][p % self.bs] = tokens[p]
            st["computed"] += n
            token = self.choose(rid, len(tokens))
            if st["computed"] == len(tokens):
                tokens.append(token)
            sampled.append(token)
        return sampled


def check_pool(sched: Scheduler) -> None:
    """Ref counts, free queue, cache map and block sharing agree with the live requests."""
    kv, pool = sched.kv, sched.kv.pool
    bs, n_blocks = kv.block_size, pool.num_blocks
    assert set(sched.requests) == {r.request_id for r in [*sched.waiting, *sched.running]}
    assert len(sched.requests) == len(sched.waiting) + len(sched.running)
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.block_ids == [] and r.num_computed_tokens == 0 and r.num_pending == 0
    holders = Counter()
    owners = defaultdict(list)  # block -> (request, index in its block table)
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
        assert len(set(r.block_ids)) == len(r.block_ids)
        for i, b in enumerate(r.block_ids):
            holders[b] += 1
            owners[b].append((r, i))
    assert pool.ref_counts == [holders[b] for b in range(n_blocks)]
    free = list(pool.free_queue)
    assert len(free) == len(set(free)) == kv.num_free_blocks
    assert set(free) == {b for b in range(n_blocks) if pool.ref_counts[b] == 0}
    assert not set(free) & set(holders)
    assert len(free) + len(holders) == n_blocks
    # The hash -> block map and the per-block hashes are one bijection.
    assert {b: h for h, b in pool.cached.items()} == {b: h for b, h in enumerate(pool.block_hashes) if h is not None}
    for r in sched.running:
        parent = b""
        for i, b in enumerate(r.block_ids[: min(r.num_computed_tokens, r.num_tokens) // bs]):
            parent = hash_block(parent, r.all_token_ids[i * bs : (i + 1) * bs])
            assert pool.block_hashes[b] in (None, parent), "a cached block is named by another prefix"
    for b, held in owners.items():
        if len(held) > 1:  # only prefix-cache blocks are shared: same place, same prefix, computed
            assert pool.block_hashes[b] is not None
            i = held[0][1]
            prefix = held[0][0].all_token_ids[: (i + 1) * bs]
            for r, j in held:
                assert j == i and r.all_token_ids[: (i + 1) * bs] == prefix
                assert r.num_computed_tokens >= (i + 1) * bs


def finishes_with_pending(sched: Scheduler, req: Request) -> bool:
    """Whether the tokens queued steps sample for req will end it by length."""
    max_tokens = req.sampling_params.max_tokens
    return req.num_pending > 0 and (
        (max_tokens is not None and len(req.output_token_ids) + req.num_pending >= max_tokens)
        or req.num_tokens + req.num_pending >= sched.config.max_model_len
    )


def check_schedule(sched: Scheduler, out, before: list[str], skipped: set[str] = frozenset()) -> None:
    """Budget, batch order, running-first and block coverage of one SchedulerOutput;
    `skipped`: running requests that their pending tokens will finish."""
    cfg, bs = sched.config, sched.kv.block_size
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(out.num_scheduled_tokens) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
    assert all(n > 0 for n in out.num_scheduled_tokens.values())
    cached_ids = [c.req_id for c in out.cached_reqs]
    new_ids = [n.req_id for n in out.new_reqs]
    assert list(out.num_scheduled_tokens) == cached_ids + new_ids  # batch order: running, then new
    # Running requests are served oldest first, before any waiting one.
    eligible = [rid for rid in before if rid not in skipped]
    assert cached_ids == eligible[: len(cached_ids)]
    if new_ids:
        assert cached_ids == eligible and out.num_preempted == 0
    # Preemption takes the newest running requests and puts them back in front, in order.
    k = out.num_preempted
    if k:
        victims = before[-k:]
        assert [r.request_id for r in list(sched.waiting)[:k]] == victims
        assert set(victims) <= out.finished_req_ids
        for rid in victims:
            r = sched.requests[rid]
            assert r.status == RequestStatus.PREEMPTED and r.block_ids == []
    assert [r.request_id for r in sched.running] == before[: len(before) - k] + new_ids
    for new in out.new_reqs:
        r = sched.requests[new.req_id]
        assert new.token_ids == r.all_token_ids and new.block_ids == r.block_ids
        assert new.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_computed_tokens
    # The step's tokens count as computed at once; blocks cover exactly them,
    # and a row samples exactly when it reaches the request's expected tokens.
    for r in sched.running:
        assert len(r.block_ids) == ceil_div(r.num_computed_tokens, bs)
        assert r.num_computed_tokens < r.num_expected  # one token (sampled or known) is always left
        assert r.num_pending == 0 or r.num_computed_tokens == r.num_expected - 1
    for req, samples in zip(out.reqs, out.samples):
        assert samples == (req.num_pending > 0)  # a scheduled request with a pending token computes it
    assert [r.request_id for r in out.reqs] == list(out.num_scheduled_tokens)
    check_pool(sched)


class Driver:
    """schedule -> fake execute -> update, checking every invariant on the way.

    release_eagerly: like EngineCore, hand the executor take_left() right
    after each update and abort, instead of waiting for the next schedule().
    overlap: like EngineCore, schedule and execute step N+1 before step N's
    tokens reach the scheduler.
    """

    def __init__(self, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, block_size=4,
                 num_blocks=64, prefix_caching=True, choose=default_token, release_eagerly=False,
                 overlap=False) -> None:
        self.sched = Scheduler(
            SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len),
            CacheConfig(block_size, num_blocks, prefix_caching),
        )
        self.executor = FakeExecutor(self.sched, choose)
        self.release_eagerly = release_eagerly
        self.overlap = overlap
        self.in_flight: deque = deque()  # (SchedulerOutput, sampled tokens) not yet given to update()
        self.num_rows = defaultdict(int)  # request id -> batch rows it took
        self.outputs: dict[str, list[int]] = defaultdict(list)  # request id -> tokens from updates
        self.finished: dict[str, tuple[str, int | None]] = {}  # request id -> finish and stop reason
        self.steps = 0
        self.admitted_tokens = self.admitted_hits = 0  # over all admissions, readmissions included

    def add(self, *reqs: Request) -> None:
        for r in reqs:
            self.sched.add_request(r)

    def abort(self, req_ids) -> list[str]:
        aborted = self.sched.abort(req_ids)
        if self.release_eagerly:
            self.executor.remove(self.sched.take_left())
        check_pool(self.sched)
        return aborted

    def step(self):
        """One step; returns its SchedulerOutput and the updates handed over in it
        (with overlap, those of the step before)."""
        before = [r.request_id for r in self.sched.running]
        skipped = {r.request_id for r in self.sched.running if finishes_with_pending(self.sched, r)}
        out = self.sched.schedule()
        check_schedule(self.sched, out, before, skipped)
        self.admitted_tokens += sum(len(new.token_ids) for new in out.new_reqs)
        self.admitted_hits += sum(new.num_computed_tokens for new in out.new_reqs)
        for rid in out.num_scheduled_tokens:
            self.num_rows[rid] += 1
        if out.num_scheduled_tokens:
            self.in_flight.append((out, self.executor.execute(out)))
        else:
            self.executor.remove(out.finished_req_ids)
        keep = 1 if self.overlap and out.num_scheduled_tokens else 0
        updates = []
        while len(self.in_flight) > keep:
            updates += self._update(*self.in_flight.popleft())
        check_pool(self.sched)
        self.steps += 1
        return out, updates

    def _update(self, out, sampled):
        updates = self.sched.update(out, sampled)
        for u in updates:
            rid = u.req.request_id
            assert list(out.num_scheduled_tokens)[u.row] == rid
            self.outputs[rid].extend(u.new_token_ids)
            assert self.outputs[rid] == u.req.output_token_ids
            if u.finish_reason is not None:
                assert rid not in self.sched.requests and u.req.finished
                self.finished[rid] = (u.finish_reason, u.stop_reason)
        if self.release_eagerly:
            self.executor.remove(self.sched.take_left())
        return updates

    def run(self, max_steps=1000) -> None:
        for _ in range(max_steps):
            if not self.sched.num_unfinished and not self.in_flight:
                break
            self.step()
        if self.sched.num_unfinished or self.in_flight:
            pytest.fail(f"not done after {max_steps} steps: {self.sched.num_unfinished} requests left")
        self.check_all_free()

    def check_all_free(self) -> None:
        kv = self.sched.kv
        assert kv.num_free_blocks == kv.pool.num_blocks
        assert all(c == 0 for c in kv.pool.ref_counts)
        assert not self.sched.requests and not self.sched.running and not self.sched.waiting


# --- continuous batching -------------------------------------------------------------------


def test_continuous_batching_respects_limits_and_admits_while_decoding():
    d = Driver(max_num_seqs=3, max_num_batched_tokens=16)
    lens = [10, 3, 7, 20, 5, 2]
    d.add(*[make_request(f"r{i}", range(1, n + 1), max_tokens=6) for i, n in enumerate(lens)])
    joined_while_decoding = 0
    for _ in range(8):
        out, _ = d.step()
        decoding = [c for c in out.cached_reqs if out.num_scheduled_tokens[c.req_id] == 1]
        joined_while_decoding += bool(out.new_reqs and decoding)
        assert len(d.sched.running) <= 3
    d.add(make_request("late", [7, 8, 9], max_tokens=4))  # arrives mid-run
    d.run()
    assert joined_while_decoding > 0
    assert d.finished == {**{f"r{i}": ("length", None) for i in range(6)}, "late": ("length", None)}
    assert {rid: len(toks) for rid, toks in d.outputs.items()} == {**{f"r{i}": 6 for i in range(6)}, "late": 4}


def test_running_requests_take_the_budget_first():
    d = Driver(max_num_seqs=4, max_num_batched_tokens=4)
    d.add(make_request("a", [1, 2, 3], max_tokens=5))
    out, _ = d.step()
    assert out.num_scheduled_tokens == {"a": 3}
    d.add(make_request("b", range(1, 10), max_tokens=2))
    out, _ = d.step()
    assert out.num_scheduled_tokens == {"a": 1, "b": 3}  # a's decode first, b gets the rest
    d.run()


# --- chunked prefill -----------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_at_its_end():
    d = Driver(max_num_batched_tokens=8, block_size=4)
    d.add(make_request("short", [1, 2, 3], max_tokens=20))
    d.add(make_request("long", range(1, 31), max_tokens=3))
    chunks, computed = [], 0
    while computed < 30:
        out, updates = d.step()
        n = out.num_scheduled_tokens["long"]
        chunks.append(n)
        computed += n
        long_updates = [u for u in updates if u.req.request_id == "long"]
        # A token comes only from the step that computes the prompt's last token.
        assert len(long_updates) == (computed == 30)
        assert d.sched.requests["long"].num_computed_tokens == computed
    assert chunks == [5, 7, 7, 7, 4]  # the budget of 8 less the other request's share
    assert sum(chunks) == 30
    d.run()
    assert len(d.outputs["long"]) == 3 and len(d.outputs["short"]) == 20


# --- block accounting ----------------------------------------------------------------------


def test_blocks_grow_one_at_a_time_and_all_return():
    d = Driver(block_size=4, num_blocks=16)
    d.add(make_request("a", range(1, 10), max_tokens=8))  # 9 prompt tokens: 3 blocks
    d.add(make_request("b", [5, 6], max_tokens=3))
    sizes = []
    while "a" in d.sched.requests:
        d.step()
        a = d.sched.requests.get("a")
        if a is not None:
            sizes.append(len(a.block_ids))
            assert len(a.block_ids) == ceil_div(a.num_computed_tokens, 4)
    # computed tokens after each step: 9, 10, ..., 15 -> 3,3,3,3,4,4,4 blocks; the 8th token finishes it
    assert sizes == [3, 3, 3, 3, 4, 4, 4]
    d.run()


# --- prefix caching ------------------------------------------------------------------------

PREFIX = list(range(1, 13))  # three full blocks of 4


def test_prefix_hit_shares_full_blocks_with_a_live_request():
    d = Driver(block_size=4)
    a = make_request("a", PREFIX + [50, 51], max_tokens=10)
    d.add(a)
    d.step()  # a's prompt is computed, its three full blocks are cached
    d.add(make_request("b", PREFIX + [60, 61, 62], max_tokens=4))
    out, _ = d.step()
    (new,) = out.new_reqs
    b = d.sched.requests["b"]
    assert new.num_computed_tokens == 12 and b.num_cached_tokens == 12
    assert out.num_scheduled_tokens["b"] == 3
    assert b.block_ids[:3] == a.block_ids[:3]
    assert not set(b.block_ids[3:]) & set(a.block_ids)
    assert all(d.sched.kv.pool.ref_counts[blk] == 2 for blk in a.block_ids[:3])
    d.run()


def test_a_fully_cached_prompt_still_computes_its_last_token():
    d = Driver(block_size=4)
    d.add(make_request("a", PREFIX, max_tokens=1))
    d.run()
    d.add(make_request("same", PREFIX, max_tokens=2))
    out, updates = d.step()
    # Twelve tokens are cached, but the block holding the last one is computed again.
    assert out.new_reqs[0].num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"same": 4}
    assert [u.req.request_id for u in updates] == ["same"]  # it samples in this very step
    d.run()
    d.add(make_request("plus1", PREFIX + [99], max_tokens=1))
    out, _ = d.step()
    assert out.new_reqs[0].num_computed_tokens == 12 and out.num_scheduled_tokens == {"plus1": 1}
    d.run()


def test_a_different_prefix_gets_no_hit_even_with_equal_later_blocks():
    d = Driver(block_size=4)
    d.add(make_request("a", PREFIX + [50], max_tokens=1))
    d.run()
    other = [77] + PREFIX[1:] + [50]  # first block differs, the next two are equal
    d.add(make_request("b", other, max_tokens=1))
    out, _ = d.step()
    assert out.new_reqs[0].num_computed_tokens == 0 and out.num_scheduled_tokens == {"b": 13}
    d.run()


def test_lru_reuses_freed_blocks_and_evicts_the_least_recently_freed():
    d = Driver(block_size=4, num_blocks=9, max_num_batched_tokens=64)
    pa, pb = list(range(1, 10)), list(range(21, 30))  # 9 tokens: two full blocks + one
    d.add(make_request("a", pa, max_tokens=1))
    d.run()
    d.add(make_request("b", pb, max_tokens=1))
    d.run()
    cache = d.sched.kv.pool.cached
    assert len(cache) == 4

    d.add(make_request("a2", pa, max_tokens=1))  # a's blocks come back from the free queue
    out, _ = d.step()
    a2 = out.new_reqs[0]
    assert a2.num_computed_tokens == 8
    a_blocks = a2.block_ids[:2]
    d.run()  # now a's blocks were freed after b's: b's are the least recently freed

    # A 24-token request needs 6 of the 9 blocks: the 4 never-cached free ones, then b's two.
    d.add(make_request("c", range(200, 224), max_tokens=1))
    out, _ = d.step()
    assert out.new_reqs[0].num_computed_tokens == 0
    assert not set(out.new_reqs[0].block_ids) & set(a_blocks)
    d.run()
    assert len(d.sched.kv.pool.cached) == 2 + 6  # a's two blocks and c's six; b's hashes are gone
    assert sorted(d.sched.kv.pool.cached.values()) == sorted(a_blocks + out.new_reqs[0].block_ids)

    d.add(make_request("a3", pa, max_tokens=1), make_request("b2", pb, max_tokens=1))
    out, _ = d.step()
    got = {n.req_id: n for n in out.new_reqs}
    assert got["a3"].num_computed_tokens == 8 and got["a3"].block_ids[:2] == a_blocks
    assert got["b2"].num_computed_tokens == 0
    d.run()


def test_a_freed_request_loses_its_tail_blocks_first():
    d = Driver(block_size=4, num_blocks=4)
    prompt = list(range(1, 14))  # 13 tokens: all four blocks, three of them full and cached
    d.add(make_request("a", prompt, max_tokens=1))
    d.step()
    a_blocks = list(d.sched.kv.pool.cached.values())
    assert len(a_blocks) == 3
    d.run()
    d.add(make_request("b", [90, 91, 92, 93, 94], max_tokens=1))  # takes two blocks
    d.run()
    # b evicted a's last cached block; the first two still serve a repeat of a's prompt.
    assert set(a_blocks[:2]) <= set(d.sched.kv.pool.cached.values())
    assert a_blocks[2] not in d.sched.kv.pool.cached.values()
    d.add(make_request("a2", prompt, max_tokens=1))
    out, _ = d.step()
    assert out.new_reqs[0].num_computed_tokens == 8 and out.new_reqs[0].block_ids[:2] == a_blocks[:2]
    d.run()


def test_disabled_prefix_caching_never_hits():
    d = Driver(block_size=4, prefix_caching=False)
    a = make_request("a", PREFIX + [50], max_tokens=6)
    d.add(a)
    d.step()
    d.add(make_request("b", PREFIX + [50], max_tokens=2))
    out, _ = d.step()
    assert out.new_reqs[0].num_computed_tokens == 0 and out.num_scheduled_tokens["b"] == 13
    assert not set(d.sched.requests["b"].block_ids) & set(a.block_ids)
    assert not d.sched.kv.pool.cached
    d.run()


# --- preemption ----------------------------------------------------------------------------


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_recomputes_the_newest_request_and_everyone_finishes(prefix_caching):
    # 6 blocks of 4 tokens; three requests that each grow to 16 tokens (4 blocks).
    d = Driver(max_num_seqs=4, block_size=4, num_blocks=6, prefix_caching=prefix_caching)
    prompts = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8], "c": [9, 10, 11, 12]}
    d.add(*[make_request(rid, p, max_tokens=12) for rid, p in prompts.items()])
    preempted, readmitted = [], []
    while d.sched.num_unfinished and d.steps < 200:
        was_preempted = {rid: list(r.all_token_ids) for rid, r in d.sched.requests.items()
                         if r.status == RequestStatus.PREEMPTED}
        newest = d.sched.running[-1].request_id if d.sched.running else None
        out, _ = d.step()
        if out.num_preempted:
            assert out.num_preempted == 1 and not out.new_reqs
            victim = d.sched.waiting[0]
            assert victim.request_id == newest and newest in out.finished_req_ids
            assert victim.num_preemptions >= 1
            preempted.append((newest, len(victim.output_token_ids)))
        for new in out.new_reqs:
            if new.req_id in was_preempted:
                # Readmitted with everything it had: prompt and generated tokens.
                tokens = was_preempted[new.req_id]
                assert new.token_ids == tokens and len(tokens) > len(prompts[new.req_id])
                assert tokens[: len(prompts[new.req_id])] == prompts[new.req_id]
                readmitted.append(new.req_id)
    assert not d.sched.num_unfinished, "scheduling did not finish: deadlock or livelock"
    d.check_all_free()
    assert preempted and preempted[0][0] == "c"
    assert readmitted and set(readmitted) <= {rid for rid, _ in preempted}
    assert d.sched.num_preemptions == len(preempted)
    for rid, prompt in prompts.items():
        # Recomputation neither loses nor repeats a token.
        assert d.outputs[rid] == [default_token(rid, len(prompt) + i) for i in range(12)]
        assert d.finished[rid] == ("length", None)


# --- finish conditions ---------------------------------------------------------------------


def scripted(tokens: dict[str, list[int]]):
    """A fake model that samples tokens[rid][k] for the k-th output of rid, then 100s."""

    def choose(rid, pos):
        return tokens.get(rid, {}).get(pos, 100)

    return choose


def run_one(prompt, outputs, max_model_len=256, **kwargs):
    choose = scripted({"r": {len(prompt) + k: t for k, t in enumerate(outputs)}})
    d = Driver(max_model_len=max_model_len, choose=choose)
    d.add(make_request("r", prompt, eos=(EOS,), **kwargs))
    d.run()
    return d.outputs["r"], d.finished["r"]


def test_finish_on_max_tokens():
    assert run_one([1, 2, 3], [], max_tokens=3) == ([100] * 3, ("length", None))


def test_finish_on_eos_token():
    assert run_one([1, 2, 3], [5, EOS, 6], max_tokens=10) == ([5, EOS], ("stop", None))


def test_ignore_eos_keeps_generating():
    assert run_one([1, 2, 3], [5, EOS, 6], max_tokens=4, ignore_eos=True) == ([5, EOS, 6, 100], ("length", None))


def test_finish_on_stop_token_id_reports_it():
    assert run_one([1, 2, 3], [5, 9, 6], max_tokens=10, stop_token_ids=[9]) == ([5, 9], ("stop", 9))
    # An EOS given as a stop token with ignore_eos still stops, as a stop token.
    assert run_one([1, 2], [EOS], max_tokens=5, ignore_eos=True, stop_token_ids=[EOS]) == ([EOS], ("stop", EOS))


def test_finish_on_max_model_len():
    assert run_one(range(1, 8), [], max_model_len=10, max_tokens=None) == ([100] * 3, ("length", None))
    assert run_one(range(1, 8), [], max_model_len=10, max_tokens=50) == ([100] * 3, ("length", None))


def test_finished_request_leaves_the_executor_next_step():
    d = Driver()
    d.add(make_request("done", [1, 2], max_tokens=1), make_request("other", [3, 4], max_tokens=3))
    _, updates = d.step()
    assert [u.finish_reason for u in updates] == ["length", None]
    out, _ = d.step()
    assert out.finished_req_ids == {"done"}
    d.run()


# --- abort ---------------------------------------------------------------------------------


def test_abort_waiting_running_and_unknown_requests():
    d = Driver(max_num_seqs=1, block_size=4, num_blocks=16)
    d.add(make_request("run", range(1, 10), max_tokens=50), make_request("wait", [1, 2], max_tokens=5))
    d.step()
    assert [r.request_id for r in d.sched.running] == ["run"] and d.sched.kv.num_free_blocks == 13
    assert d.sched.abort(["nope", "wait", "run", "nope2"]) == ["wait", "run"]
    assert d.sched.kv.num_free_blocks == 16 and not d.sched.requests
    check_pool(d.sched)
    out = d.sched.schedule()
    # Only the request that held an executor slot leaves it.
    assert out.finished_req_ids == {"run"} and not out.num_scheduled_tokens
    assert d.sched.abort(["run"]) == []
    d.check_all_free()


def test_abort_during_a_step_drops_its_token_and_frees_blocks():
    d = Driver(block_size=4)
    d.add(make_request("a", [1, 2, 3], max_tokens=5), make_request("b", [4, 5, 6], max_tokens=5))
    out = d.sched.schedule()
    sampled = d.executor.execute(out)
    assert d.sched.abort(["a"]) == ["a"]
    updates = d.sched.update(out, sampled)
    assert [u.req.request_id for u in updates] == ["b"] and updates[0].row == 1
    d.outputs["b"].extend(updates[0].new_token_ids)
    check_pool(d.sched)
    out, _ = d.step()
    assert out.finished_req_ids == {"a"} and list(out.num_scheduled_tokens) == ["b"]
    d.run()


def test_abort_a_preempted_request():
    d = Driver(max_num_seqs=4, block_size=4, num_blocks=4)
    d.add(make_request("a", [1, 2, 3, 4], max_tokens=8), make_request("b", [5, 6, 7, 8], max_tokens=8))
    while not any(r.status == RequestStatus.PREEMPTED for r in d.sched.requests.values()):
        assert d.steps < 50
        d.step()
    assert d.sched.abort(["b"]) == ["b"]
    check_pool(d.sched)
    d.run()
    assert "b" not in d.finished and d.finished["a"] == ("length", None)


def test_take_left_hands_over_leaving_requests_at_once():
    d = Driver()
    d.add(make_request("done", [1, 2], max_tokens=1), make_request("run", [3, 4], max_tokens=5))
    d.step()
    assert d.sched.take_left() == {"done"}  # EngineCore frees the slot right after update
    d.add(make_request("wait", [5]))
    assert d.sched.abort(["run", "wait"]) == ["run", "wait"]
    assert d.sched.take_left() == {"run"}  # "wait" never held a slot
    out = d.sched.schedule()
    assert not out.finished_req_ids and not out.num_scheduled_tokens
    d.check_all_free()


def test_abort_with_a_repeated_id_aborts_it_once():
    d = Driver()
    d.add(make_request("a", [1, 2], max_tokens=5))
    d.step()
    assert d.sched.abort(["a", "a"]) == ["a"]
    d.check_all_free()


def test_duplicate_request_id_is_rejected_until_the_first_finishes():
    d = Driver()
    d.add(make_request("a", [1, 2], max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        d.add(make_request("a", [3, 4]))
    d.run()
    d.outputs.pop("a")
    d.add(make_request("a", [3, 4], max_tokens=1))  # a finished id may be used again
    d.run()


# --- randomized ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seed, prefix_caching, release_eagerly, overlap",
    [(0, True, False, False), (1, True, True, False), (2, False, True, False), (3, True, True, True),
     (4, False, True, True), (5, True, True, True)],
)
def test_random_arrivals_aborts_and_shared_prefixes_keep_invariants(seed, prefix_caching, release_eagerly, overlap):
    """Random arrivals, aborts, lengths and shared prefixes on a pool of 12 blocks; the Driver checks
    every invariant after every schedule, update and abort (with overlap, while a step is in flight)."""
    rng = random.Random(seed)
    bs, max_model_len = 4, 40
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 17))] for _ in range(3)]

    def choose(rid, pos):
        return EOS if rng.random() < 0.03 else rng.randrange(1, 50)

    d = Driver(max_num_seqs=4, max_num_batched_tokens=rng.choice([8, 16, 32]), max_model_len=max_model_len,
               block_size=bs, num_blocks=12, prefix_caching=prefix_caching, choose=choose,
               release_eagerly=release_eagerly, overlap=overlap)
    added, aborted, params = 0, set(), {}  # request id -> (prompt length, max_tokens, ignore_eos)
    for _ in range(300):
        if rng.random() < 0.3:
            rid = f"r{added}"
            added += 1
            head = rng.choice(prefixes) if rng.random() < 0.6 else []
            prompt = (head + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 20))])[: max_model_len - 1]
            params[rid] = (len(prompt), rng.choice([None, 1, 5, 30]), rng.random() < 0.2)
            d.add(make_request(rid, prompt, max_tokens=params[rid][1], ignore_eos=params[rid][2]))
        if rng.random() < 0.05 and d.sched.requests:
            rid = rng.choice(sorted(d.sched.requests))
            assert d.abort([rid, "unknown"]) == [rid]
            aborted.add(rid)
        d.step()
    d.run(max_steps=2000)
    assert set(d.finished) | aborted == set(params) and not set(d.finished) & aborted
    for rid, (reason, stop_reason) in d.finished.items():
        out, (prompt_len, max_tokens, ignore_eos) = d.outputs[rid], params[rid]
        assert stop_reason is None
        stops = [i for i, t in enumerate(out) if t == EOS] if not ignore_eos else []
        if reason == "stop":
            assert stops == [len(out) - 1]
        else:
            assert reason == "length" and not stops
            assert len(out) == max_tokens or prompt_len + len(out) == max_model_len
    assert d.sched.num_preemptions > 0 and d.admitted_hits == d.sched.kv.num_hits
    if d.sched.kv.enable_prefix_caching:
        assert d.admitted_hits > 0
        assert d.admitted_tokens == d.sched.kv.num_queries  # each admission looked up once


# --- overlap: step N+1 scheduled before step N reports -----------------------------------------


def test_overlap_feeds_pending_tokens_and_never_schedules_a_request_past_max_tokens():
    d = Driver(overlap=True, block_size=4)
    d.add(make_request("a", [1, 2, 3], max_tokens=5), make_request("b", range(1, 10), max_tokens=1))
    out, updates = d.step()
    assert out.num_scheduled_tokens == {"a": 3, "b": 9} and updates == []  # nothing read back yet
    out, updates = d.step()
    # a decodes its pending token; b's one token is pending, so b is done and not scheduled again.
    a = d.sched.requests["a"]
    assert out.num_scheduled_tokens == {"a": 1} and a.num_pending == 1 and len(a.output_token_ids) == 1
    assert {u.req.request_id: u.finish_reason for u in updates} == {"a": None, "b": "length"}
    d.run()
    assert d.outputs["a"] == [default_token("a", p) for p in range(3, 8)] and d.num_rows["a"] == 5
    assert d.num_rows["b"] == 1


def test_overlap_computes_one_extra_row_after_eos_and_drops_it():
    choose = scripted({"r": {4: EOS}})  # the second output is EOS
    d = Driver(overlap=True, choose=choose)
    d.add(make_request("r", [1, 2, 3], max_tokens=10))
    d.run()
    assert d.outputs["r"] == [100, EOS] and d.finished["r"] == ("stop", None)
    # The step after EOS was queued before EOS was read back: one row more than the tokens.
    assert d.num_rows["r"] == 3


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_overlap_preemption_drops_the_victims_in_flight_token_and_loses_nothing(prefix_caching):
    d = Driver(max_num_seqs=4, block_size=4, num_blocks=6, prefix_caching=prefix_caching, overlap=True)
    prompts = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8], "c": [9, 10, 11, 12]}
    d.add(*[make_request(rid, p, max_tokens=12) for rid, p in prompts.items()])
    d.run()
    assert d.sched.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert d.outputs[rid] == [default_token(rid, len(prompt) + i) for i in range(12)]
        assert d.finished[rid] == ("length", None)


def test_overlap_abort_while_in_flight_drops_the_row():
    d = Driver(overlap=True, release_eagerly=True)
    d.add(make_request("a", [1, 2, 3], max_tokens=5), make_request("b", [4, 5, 6], max_tokens=5))
    d.step()  # step 1 in flight
    assert d.abort(["a"]) == ["a"]
    _, updates = d.step()  # step 2 queued with b alone, step 1 read back: a's row dropped
    assert [u.req.request_id for u in updates] == ["b"]
    d.run()
    assert "a" not in d.outputs and len(d.outputs["b"]) == 5
