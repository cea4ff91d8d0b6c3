"""Paged KV-cache bookkeeping: the block pool, prefix caching, per-request blocks.

Plain Python: the executor owns the KV tensors; this module only decides
which block ids hold which tokens.

Prefix caching: every full block of a request is named by a hash chain,
hash(parent block's hash, the block's token ids), so equal hashes mean equal
prefixes. A full, computed block is registered under its hash. Freed blocks
keep their hash and wait at the tail of an LRU free queue; a later request
with the same prefix takes them back from the queue (a hit), and allocation
evicts from the queue's head, the least recently freed block first.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

from headrace.core.request import Request


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    return h.digest()


class BlockPool:
    """Reference counts, the LRU free queue and the hash -> block map."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self.free_queue), "caller checks capacity first"
        ids = []
        for _ in range(n):
            bid, _ = self.free_queue.popitem(last=False)
            self._evict(bid)
            self.ref_counts[bid] = 1
            ids.append(bid)
        return ids

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks found by lookup()."""
        for bid in block_ids:
            if self.ref_counts[bid] == 0:
                del self.free_queue[bid]
            self.ref_counts[bid] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference each; pass tail blocks first so they are evicted first."""
        for bid in block_ids:
            self.ref_counts[bid] -= 1
            assert self.ref_counts[bid] >= 0, f"block {bid} freed twice"
            if self.ref_counts[bid] == 0:
                self.free_queue[bid] = None

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks holding the longest cached prefix of this hash chain."""
        ids = []
        for h in hashes:
            bid = self.cached.get(h)
            if bid is None:
                break
            ids.append(bid)
        return ids

    def num_free_among(self, block_ids: list[int]) -> int:
        return sum(1 for bid in block_ids if self.ref_counts[bid] == 0)

    def register(self, bid: int, block_hash: bytes) -> None:
        if self.block_hashes[bid] is None and block_hash not in self.cached:
            self.block_hashes[bid] = block_hash
            self.cached[block_hash] = bid

    def _evict(self, bid: int) -> None:
        h = self.block_hashes[bid]
        if h is not None:
            del self.cached[h]
            self.block_hashes[bid] = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; blocks in use keep their contents."""
        for bid in range(self.num_blocks):
            self.block_hashes[bid] = None
        self.cached.clear()


class KVCacheManager:
    """Which blocks each request holds, and prefix-cache hits for new ones."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._hashes: dict[str, list[bytes]] = {}  # request id -> hash chain of its full blocks
        self._num_registered: dict[str, int] = {}  # request id -> leading blocks already registered
        self.num_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_hits = 0  # of those, tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_hashes(self, req: Request) -> list[bytes]:
        """The hash chain over req's full blocks, extended as tokens arrive."""
        hashes = self._hashes.setdefault(req.request_id, [])
        bs = self.block_size
        for i in range(len(hashes), req.num_tokens // bs):
            parent = hashes[i - 1] if i else b""
            hashes.append(hash_block(parent, req.all_token_ids[i * bs : (i + 1) * bs]))
        return hashes

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Cached blocks holding req's longest known prefix.

        At least the last token is left to compute, since the step that
        computes it also yields the next token's logits.
        """
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        max_blocks = (req.num_tokens - 1) // self.block_size
        return self.pool.lookup(self.block_hashes(req)[:max_blocks])

    def allocate(self, req: Request, num_new_tokens: int, cached_blocks: list[int] = (),
                 reserve: int = 0) -> list[int] | None:
        """Give req blocks for num_new_tokens beyond its computed (or cached) ones.

        Returns the newly added block ids, or None, changing nothing, when
        the pool cannot hold them and `reserve` blocks more (which the caller
        then takes with pool.allocate).
        """
        num_computed = len(cached_blocks) * self.block_size if cached_blocks else req.num_computed_tokens
        need = self.blocks_needed(num_computed + num_new_tokens) - len(req.block_ids) - len(cached_blocks)
        if need <= 0 and req.block_ids and not reserve:  # a running request with room left: most steps
            return []
        if max(need, 0) + reserve > self.pool.num_free - self.pool.num_free_among(cached_blocks):
            return None
        if not req.block_ids and self.enable_prefix_caching:
            # Admission (a running request always holds a block). Counted
            # here, not in find_cached_prefix: a request the pool cannot take
            # yet is looked up again every step and would be counted each time.
            self.num_queries += req.num_tokens
            self.num_hits += len(cached_blocks) * self.block_size
        if cached_blocks:
            self.pool.touch(cached_blocks)
        new = self.pool.allocate(max(need, 0))
        req.block_ids.extend(cached_blocks)
        req.block_ids.extend(new)
        return list(cached_blocks) + new

    def cache_computed_blocks(self, req: Request) -> None:
        """Register req's full blocks whose KV is computed (or queued to be)
        and whose tokens are all known (pending samples are not)."""
        if not self.enable_prefix_caching:
            return
        start = self._num_registered.get(req.request_id, 0)
        end = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        if end <= start:
            return
        hashes = self.block_hashes(req)
        for i in range(start, end):
            self.pool.register(req.block_ids[i], hashes[i])
        self._num_registered[req.request_id] = max(start, end)

    def num_registered_blocks(self, req: Request) -> int:
        """req's leading blocks that cache_computed_blocks has registered."""
        return self._num_registered.get(req.request_id, 0)

    def share(self, req: Request, block_ids: list[int], num_shared: int) -> None:
        """Give req these blocks: the first num_shared held by others too
        (one more reference each), the rest newly allocated for it."""
        self.pool.touch(block_ids[:num_shared])
        req.block_ids = list(block_ids)

    def fork(self, beams: list[Request], parents: list[int], num_tokens: int) -> None:
        """Beam j now continues beam parents[j]: it takes its parent's blocks
        holding full blocks of the first num_tokens tokens (references move
        with them) and keeps its own blocks after those (its copy of a partial
        block, blocks allocated since)."""
        full = num_tokens // self.block_size
        olds = [b.block_ids for b in beams]
        dropped = []
        for beam, parent, old in zip(beams, parents, olds):
            new = olds[parent]
            if new is old:
                continue
            k = 0  # the blocks both hold (the prompt's, those of common ancestors) change nothing
            while k < full and new[k] == old[k]:
                k += 1
            if k == full:
                continue
            self.pool.touch(new[k:full])
            dropped.extend(reversed(old[k:full]))
            beam.block_ids = new[:full] + old[full:]
        self.pool.free(dropped)

    def free(self, req: Request) -> None:
        self.pool.free(list(reversed(req.block_ids)))
        req.block_ids = []
        self._hashes.pop(req.request_id, None)
        self._num_registered.pop(req.request_id, None)
