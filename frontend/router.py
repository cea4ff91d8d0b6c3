"""Which data-parallel core a new request goes to.

Plain Python, no torch: a frontend routes before anything leaves it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

ROUTING_MODES = ("prefix", "least_loaded")
# A core holding the prompt's prefix may carry this many more live requests
# than the least loaded core, or half the least load when that is more (see Router).
MIN_SLACK = 4


def check_routing(routing) -> str:
    """A user's routing option, checked."""
    if routing not in ROUTING_MODES:
        raise ValueError(f"routing must be one of {', '.join(map(repr, ROUTING_MODES))}, got {routing!r}")
    return routing


def slack(least_load: int) -> int:
    """How much busier than the least loaded core a core with the prompt's prefix may be."""
    return max(MIN_SLACK, least_load // 2)


def block_prefix_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """One hash per full block of block_size tokens, each naming the whole
    prefix up to that block's end (a chain, as the core's prefix cache names
    blocks). Python's tuple hash, not the core's blake2b: about 13 us for a
    thousand tokens, and a collision only sends a request to the wrong core,
    which then computes what it does not have."""
    t = tuple(token_ids)
    hashes, h = [], 0
    for end in range(block_size, len(t) + 1, block_size):
        h = hash((h, t[end - block_size : end]))
        hashes.append(h)
    return hashes


class PrefixRecord:
    """The block-prefix hashes one frontend sent to one core, least recently
    sent first, at most `capacity` of them: about what the core's prefix
    cache (an LRU over its num_kv_blocks blocks) can still hold. It knows
    nothing of other frontends' requests or of the blocks that generated
    tokens fill, so it is a guess; a wrong one costs a recomputed prefix."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.hashes: OrderedDict[int, None] = OrderedDict()  # block-prefix hash -> nothing, LRU first

    def __len__(self) -> int:
        return len(self.hashes)

    def num_matched(self, hashes: list[int]) -> int:
        """How many leading blocks of the chain are recorded."""
        n = 0
        for h in hashes:
            if h not in self.hashes:
                break
            n += 1
        return n

    def add(self, hashes: list[int]) -> None:
        # Last block first, so a prompt's first blocks are the most recent and
        # the last evicted: a prefix is useless once its head is gone (the core
        # frees a request's blocks tail first for the same reason).
        for h in reversed(hashes):
            self.hashes[h] = None
            self.hashes.move_to_end(h)
        while len(self.hashes) > self.capacity:
            self.hashes.popitem(last=False)


class Router:
    """Picks the core for each new request of one frontend.

    load[i] is the number of this frontend's live requests on core i; a dead
    core (alive[i] False) is never picked. The least loaded core is the live
    core with the smallest load, ties going to the first at or after the core
    picked last (round robin).

    routing="least_loaded": always the least loaded core.

    routing="prefix" (the default): each core has a PrefixRecord of the
    prompts' block-prefix hashes this frontend sent it, over its own
    block_size, bounded by its number of KV blocks. For a new request, m[i]
    is the number of leading full blocks of the prompt in core i's record;
    the best core is the live core with the largest m[i] (ties: the least
    loaded among them, then round robin). The request goes to the best core
    when m[best] >= 1 and

        load[best] <= least_load + max(4, least_load // 2)

    and otherwise to the least loaded core. The chosen core's record then
    takes every full block of the prompt. Why this slack: a prefix hit saves
    the prefill of the shared blocks (a thousand-token system prompt is as
    many tokens of a step's budget as a thousand decode rows), while a few
    more rows in a decode batch cost little (a decode step reads the weights
    once whatever the batch). Without a bound, one popular prefix would pile
    onto one core and idle the others; half the least load caps that at
    1.5x once loads are high, where more rows do cost (KV reads,
    preemptions), and the floor of 4 keeps routing sticky at low loads,
    where half would be 0 or 1. A prefix too popular for one core spills
    over, and its next requests may go to either core holding it.

    With one core, or least_loaded, nothing is hashed. Prompts shorter than a
    block match nothing and go to the least loaded core, as do prompts whose
    prefix no core holds: distinct prompts spread as under least_loaded.
    """

    def __init__(self, block_sizes: Sequence[int], num_kv_blocks: Sequence[int], routing: str = "prefix") -> None:
        assert len(block_sizes) == len(num_kv_blocks) > 0
        self.routing = check_routing(routing)
        self.block_sizes = list(block_sizes)  # core -> its KV block size (tokens)
        self.records = [PrefixRecord(n) for n in num_kv_blocks]  # core -> what it was sent
        self.last = -1  # the core picked last

    def choose(self, token_ids: Sequence[int], load: Sequence[int], alive: Sequence[bool]) -> int:
        n = len(self.records)
        live = [i for i in range(n) if alive[i]]
        if not live:
            raise RuntimeError("no live core to send a request to")
        after = self.last + 1

        def order(i: int) -> tuple[int, int]:  # least loaded first, then round robin from the last pick
            return load[i], (i - after) % n

        least = min(live, key=order)
        if self.routing == "least_loaded" or n == 1:
            self.last = least
            return least
        chains = {bs: block_prefix_hashes(token_ids, bs) for bs in set(self.block_sizes)}
        matched = [self.records[i].num_matched(chains[self.block_sizes[i]]) if alive[i] else 0 for i in range(n)]
        best = min(live, key=lambda i: (-matched[i], *order(i)))
        chosen = best if matched[best] and load[best] <= load[least] + slack(load[least]) else least
        self.records[chosen].add(chains[self.block_sizes[chosen]])
        self.last = chosen
        return chosen
