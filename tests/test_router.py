"""Data-parallel routing (frontend/router.py): the rule on its own, then two cores that share prompts."""
from __future__ import annotations

import asyncio
import random

import pytest

from headrace import AsyncEngine, RequestOutputKind, SamplingParams
from headrace.frontend.router import PrefixRecord, Router, block_prefix_hashes
from tests.conftest import hf_greedy

BS = 4  # block size of the unit tests
ALIVE = [True, True]


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(500) for _ in range(n)]  # inside the tiny tokenizer's vocabulary


SYSTEM = tokens(0, 4 * BS)  # four full blocks


def test_the_chain_names_prefixes():
    a = block_prefix_hashes(SYSTEM + [1, 2, 3], BS)
    b = block_prefix_hashes(SYSTEM + [9, 9, 9, 9, 9], BS)
    assert len(a) == 4 and len(b) == 5 and a == b[:4]  # only full blocks; equal prefixes, equal hashes
    c = block_prefix_hashes([SYSTEM[0] + 1] + SYSTEM[1:], BS)
    assert not set(a) & set(c)  # a different first block changes every later hash


def test_a_shared_prefix_goes_to_the_core_that_has_it():
    r = Router([BS, BS], [100, 100])
    load = [0, 0]
    first = r.choose(SYSTEM + [1], load, ALIVE)
    assert first == 0
    load[first] += 1
    assert r.choose(tokens(1, 20), load, ALIVE) == 1  # nothing shared: the least loaded core
    load[1] += 1
    for i in range(3):  # within the slack of 4 above the least loaded core, the prefix wins
        assert r.choose(SYSTEM + [i, i, i, i, i], load, ALIVE) == 0
        load[0] += 1
    assert load == [4, 1]


def test_a_much_busier_core_is_skipped():
    r = Router([BS, BS], [100, 100])
    assert r.choose(SYSTEM, [0, 0], ALIVE) == 0
    assert r.choose(SYSTEM, [4, 0], ALIVE) == 0  # 4 <= 0 + max(4, 0)
    assert r.choose(SYSTEM, [5, 0], ALIVE) == 1  # 5 > 0 + 4: the least loaded core
    # Both cores now hold the prefix: the less loaded of them.
    assert r.choose(SYSTEM, [3, 2], ALIVE) == 1
    r = Router([BS, BS], [100, 100])
    assert r.choose(SYSTEM, [0, 0], ALIVE) == 0
    assert r.choose(SYSTEM, [30, 20], ALIVE) == 0  # 30 <= 20 + 20 // 2
    assert r.choose(SYSTEM, [31, 20], ALIVE) == 1  # 31 > 20 + 10


def test_the_longest_match_wins():
    r = Router([BS, BS], [100, 100])
    assert r.choose(SYSTEM[:BS], [0, 0], ALIVE) == 0  # core 0: one block of SYSTEM
    assert r.choose(SYSTEM, [0, 1], [False, True]) == 1  # core 1: all four
    assert r.choose(SYSTEM + [5], [0, 2], ALIVE) == 1


def test_no_match_or_a_short_prompt_goes_to_the_least_loaded_core_in_turn():
    r = Router([BS, BS], [100, 100])
    assert r.choose(SYSTEM, [0, 0], ALIVE) == 0
    assert r.choose(tokens(2, 20), [1, 0], ALIVE) == 1  # no block in common
    assert r.choose(SYSTEM[:BS - 1], [0, 1], ALIVE) == 0  # shorter than a block: matches nothing
    assert r.choose(SYSTEM[:BS - 1], [1, 0], ALIVE) == 1
    # Equal loads: round robin from the last pick, as least_loaded does, even with a partial first block.
    assert [r.choose(tokens(i, BS - 1), [0, 0], ALIVE) for i in range(4)] == [0, 1, 0, 1]


def test_least_loaded_routing_ignores_prefixes():
    r = Router([BS, BS], [100, 100], routing="least_loaded")
    assert r.choose(SYSTEM, [0, 0], ALIVE) == 0
    assert r.choose(SYSTEM, [1, 0], ALIVE) == 1
    assert [len(rec) for rec in r.records] == [0, 0]  # nothing hashed or recorded


def test_one_core_hashes_nothing():
    r = Router([BS], [100])
    assert r.choose(SYSTEM, [7], [True]) == 0
    assert len(r.records[0]) == 0


def test_a_dead_core_is_never_chosen():
    r = Router([BS, BS], [100, 100])
    assert r.choose(SYSTEM, [0, 0], ALIVE) == 0
    assert r.choose(SYSTEM, [0, 3], [False, True]) == 1  # has the prefix and the least load, but dead
    with pytest.raises(RuntimeError, match="no live core"):
        r.choose(SYSTEM, [0, 0], [False, False])


def test_the_record_is_an_lru_bounded_by_the_kv_blocks():
    rec = PrefixRecord(capacity=6)
    a, b = block_prefix_hashes(SYSTEM, BS), block_prefix_hashes(tokens(3, 4 * BS), BS)
    rec.add(a)
    rec.add(b)
    assert len(rec) == 6
    assert rec.num_matched(b) == 4
    assert rec.num_matched(a) == 2  # a's tail went first; its head blocks still match
    rec.add(a)  # a is recent again: b loses its tail
    assert rec.num_matched(a) == 4 and rec.num_matched(b) == 2
    r = Router([BS, BS], [3, 3])  # through the router: a core remembers 3 blocks at most
    for i in range(10):
        r.choose(tokens(10 + i, 4 * BS), [0, 0], ALIVE)
    assert all(len(rec) == 3 for rec in r.records)


def test_routing_is_checked():
    for bad in ("round_robin", None, 1):
        with pytest.raises(ValueError, match="routing must be one of 'prefix', 'least_loaded'"):
            AsyncEngine("ipc:///nonexistent", routing=bad)
        with pytest.raises(ValueError, match="routing must be one of"):
            AsyncEngine.from_model("no-such-model", data_parallel_size=2, routing=bad)  # before spawning anything


@pytest.mark.parametrize("routing", ["prefix", "least_loaded"])
def test_shared_system_prompts_stay_on_their_core_and_hit_its_cache(checkpoint, hf_model, routing):
    """Two system prompts of many blocks, each followed by distinct user parts: after each system
    prompt's first request (which fills a core's cache), its later requests, sent all at once, go to
    that same core, take the system prompt's blocks from its prefix cache, and match transformers.
    least_loaded alternates and half of them miss."""
    path = checkpoint("qwen3")
    sp = SamplingParams(temperature=0, max_tokens=6, output_kind=RequestOutputKind.DELTA)
    systems = [tokens(100 + s, 64) for s in range(2)]  # 8 blocks of 8 tokens each
    users = [[systems[s] + tokens(200 + 10 * s + u, 5 + 3 * u) for u in range(3)] for s in range(2)]

    async def run(engine, prompt):
        state = await engine.add_request(prompt, sp)
        ids, cached = [], None
        async for out in engine.outputs(state):
            ids += out.outputs[0].token_ids
            cached = out.num_cached_tokens
        return state.core, ids, cached

    async def main():
        async with AsyncEngine.from_model(str(path), data_parallel_size=2, max_model_len=256, block_size=8,
                                          device="cpu", routing=routing) as engine:
            firsts = [await run(engine, users[s][0]) for s in range(2)]  # one at a time: cores 0 and 1
            rest = await asyncio.gather(*(run(engine, p) for s in range(2) for p in users[s][1:]))
            return firsts, rest

    firsts, rest = asyncio.run(main())
    assert [core for core, _, _ in firsts] == [0, 1]
    assert [cached for _, _, cached in firsts] == [0, 0]
    if routing == "prefix":
        assert [core for core, _, _ in rest] == [0, 0, 1, 1]
        assert [cached for _, _, cached in rest] == [64] * 4  # the system prompt's 8 blocks, from the cache
    else:
        assert [core for core, _, _ in rest] == [0, 1, 0, 1]
        assert [cached for _, _, cached in rest] == [64, 0, 0, 64]
    model = hf_model(path)
    got = [ids for _, ids, _ in firsts[:1] + rest[:2] + firsts[1:] + rest[2:]]
    assert got == [hf_greedy(model, p, 6) for s in range(2) for p in users[s]]
