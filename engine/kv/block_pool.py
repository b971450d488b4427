"""The KV block pool: reference counts, the free list and the prefix cache.

Every physical block has a reference count (how many sequences hold it). A full block may carry a
content hash that names its whole prefix (hash of the parent block's hash and the block's token ids);
such a block stays findable in the prefix cache after its last holder releases it, until the pool
needs the space. Unreferenced blocks are kept in one ordered dict used as an LRU queue: blocks without
a hash are handed out first (they hold nothing worth keeping), then cached blocks, least recently
released first. Allocate, free, hit and evict are O(1).

For program-aware scheduling (core/scheduler.py) the pool also keeps a second, low-priority queue of cached
blocks (a closed thread's, evicted before other cached blocks), a set of `protected` hashes (prefixes that
queued work needs now: evicted only when nothing else is left), and the hashes of recently evicted blocks
(so that computing one of them again is counted as recomputation).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids) -> BlockHash:
    """128-bit BLAKE2b of (parent hash, token ids).

    Why 128 bits suffices: the chance that any two of N distinct prefixes collide is about
    N^2 / 2^129; a billion cached blocks gives ~1e-21, far below the rate of hardware memory errors.
    """
    h = hashlib.blake2b(digest_size=16)
    if parent is not None:
        h.update(parent)
    h.update(array("l", token_ids).tobytes())
    return h.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: BlockHash | None = None  # set once the block is full and registered in the prefix cache


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Unreferenced blocks. Uncached ones live in a plain list (taken first); cached ones in LRU order.
        self._free_uncached: list[int] = list(range(num_blocks - 1, -1, -1))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._free_cold: OrderedDict[int, None] = OrderedDict()  # low priority: evicted before _free_cached
        self.protected: set[BlockHash] = set()  # evicted last (set_protected)
        self.evicted_hashes: OrderedDict[BlockHash, None] = OrderedDict()  # recent evictions (bounded)
        self.max_evicted_hashes = max(4096, 8 * num_blocks)
        self.cached: dict[BlockHash, int] = {}
        self.num_shared = 0  # blocks with ref_count > 1, kept up to date incrementally
        self.evictions = 0
        self.peak_used = 0
        # Cache-event feed for a replica router (flowrt.replicas): off unless enable_events() is called.
        self.events: deque[tuple[bool, BlockHash]] | None = None  # (stored?, hash), oldest first
        self.events_dropped = 0  # events lost to the bound since enabled (the reader then resyncs)

    def enable_events(self, maxlen: int = 65536) -> None:
        """Record (True, hash) when a block enters the prefix cache and (False, hash) when one leaves it, in a
        bounded queue that another thread drains with popleft (deque appends/pops are thread-safe)."""
        self.events = deque(maxlen=maxlen)

    def _event(self, stored: bool, block_hash: BlockHash) -> None:
        ev = self.events
        if ev is not None:
            if len(ev) == ev.maxlen:
                self.events_dropped += 1
            ev.append((stored, block_hash))

    def set_protected(self, hashes: set[BlockHash]) -> None:
        """Cached blocks with these hashes are evicted only when no other is left (the prefixes queued work
        needs now: the scheduler applies its policy's ranking)."""
        self.protected = hashes

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (uncached free + evictable cached)."""
        return len(self._free_uncached) + len(self._free_cached) + len(self._free_cold)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    # ---- reference counting -------------------------------------------------------------------
    def allocate(self) -> int:
        if self._free_uncached:
            bid = self._free_uncached.pop()
        elif self._free_cached or self._free_cold:
            bid = self._pop_evictable()
            blk = self.blocks[bid]
            h = blk.hash
            assert h is not None  # evictable blocks are cached, so named
            del self.cached[h]
            self._event(False, h)
            self.evicted_hashes[h] = None
            if len(self.evicted_hashes) > self.max_evicted_hashes:
                self.evicted_hashes.popitem(last=False)
            blk.hash = None
            self.evictions += 1
        else:
            raise NoFreeBlocksError("no free KV blocks")
        self.blocks[bid].ref_count = 1
        self._track_peak()
        return bid

    def _pop_evictable(self) -> int:
        """The cached block to evict: low-priority ones first, then least recently released; blocks whose
        hash is protected are passed over while any other is left."""
        for q in (self._free_cold, self._free_cached):
            if not q:
                continue
            if not self.protected:
                return q.popitem(last=False)[0]
            for _ in range(len(q)):
                bid = next(iter(q))
                if self.blocks[bid].hash not in self.protected:
                    del q[bid]
                    return bid
                q.move_to_end(bid)
        return (self._free_cold or self._free_cached).popitem(last=False)[0]

    def incref(self, bid: int) -> None:
        blk = self.blocks[bid]
        if blk.ref_count == 0:  # a prefix-cache hit on a released block: take it off the free queue
            if bid in self._free_cached:
                del self._free_cached[bid]
            else:
                del self._free_cold[bid]
            self._track_peak()
        elif blk.ref_count == 1:
            self.num_shared += 1
        blk.ref_count += 1

    def decref(self, bid: int, low_priority: bool = False) -> None:
        blk = self.blocks[bid]
        if blk.ref_count <= 0:
            raise AssertionError(f"block {bid} released more often than held")
        blk.ref_count -= 1
        if blk.ref_count == 1:
            self.num_shared -= 1
        elif blk.ref_count == 0:
            if blk.hash is not None:
                # most recently released = evicted last; low priority ones before all others
                (self._free_cold if low_priority else self._free_cached)[bid] = None
            else:
                self._free_uncached.append(bid)

    def register(self, bid: int, block_hash: BlockHash) -> None:
        """Make a full, held block findable by its content hash (first writer wins on duplicates)."""
        if not self.enable_prefix_caching:
            return
        blk = self.blocks[bid]
        if blk.hash is not None or block_hash in self.cached:
            return
        blk.hash = block_hash
        self.cached[block_hash] = bid
        self._event(True, block_hash)

    def evict_all_cached(self) -> int:
        """Drop every unreferenced cached block from the prefix cache (tests, memory release)."""
        n = 0
        while self._free_cached or self._free_cold:
            bid, _ = (self._free_cold or self._free_cached).popitem(last=False)
            blk = self.blocks[bid]
            h = blk.hash
            assert h is not None  # evictable blocks are cached, so named
            del self.cached[h]
            self._event(False, h)
            blk.hash = None
            self._free_uncached.append(bid)
            n += 1
        return n

    def _track_peak(self) -> None:
        used = self.num_used
        if used > self.peak_used:
            self.peak_used = used

    def check_invariants(self) -> None:
        """Consistency of the free structures and counters (used by tests)."""
        free = set(self._free_uncached) | set(self._free_cached) | set(self._free_cold)
        assert len(free) == len(self._free_uncached) + len(self._free_cached) + len(self._free_cold)
        for blk in self.blocks:
            assert (blk.ref_count == 0) == (blk.block_id in free), blk
            if blk.hash is not None:
                assert self.cached[blk.hash] == blk.block_id
            if blk.block_id in self._free_cached or blk.block_id in self._free_cold:
                assert blk.hash is not None
        assert self.num_shared == sum(1 for b in self.blocks if b.ref_count > 1)
        assert len(self.cached) == sum(1 for b in self.blocks if b.hash is not None)
