"""An approximate index of which replica holds which prefix blocks, for prefix-aware routing.

Keys are the engine's block hashes (``flowrt.engine.hash_block``: a hash of the parent block's
hash and the block's token ids, so one hash names a whole prefix). The index is inverted (hash -> the
replicas that hold it) so that matching a prompt costs O(blocks looked at), whatever the number of
replicas. It is approximate: it learns from the replicas' cache events (stored / evicted) a poll interval
late, and the router adds a prompt's blocks to the replica it sends it to at once (so a burst of runs that
share a prefix follows the first one before any event comes back). Each replica's entries are capped (LRU),
so a prediction that never materialized cannot grow the index without bound.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence


def chain_hashes(token_ids: Sequence[int], block_size: int, limit: int | None = None) -> list[bytes]:
    """The prefix hashes of the first full blocks of ``token_ids`` (at most ``limit``), as the engine names them."""
    from ..engine import hash_block  # here: the runtime imports this module, and flowrt.engine costs torch

    n = len(token_ids) // block_size
    if limit is not None:
        n = min(n, limit)
    out: list[bytes] = []
    parent = None
    for i in range(n):
        parent = hash_block(parent, list(token_ids[i * block_size:(i + 1) * block_size]))
        out.append(parent)
    return out


class PrefixIndex:
    def __init__(self, block_size: int, max_query_blocks: int = 64, capacity_per_replica: int = 1 << 20) -> None:
        self.block_size = block_size
        self.max_query_blocks = max_query_blocks
        self.capacity = capacity_per_replica
        self._holders: dict[bytes, set[int]] = {}
        self._by_replica: dict[int, OrderedDict[bytes, None]] = {}

    def hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """The hashes of the prompt's first full blocks (at most ``max_query_blocks``)."""
        return chain_hashes(token_ids, self.block_size, self.max_query_blocks)

    def add(self, replica: int, hashes: Iterable[bytes]) -> None:
        mine = self._by_replica.setdefault(replica, OrderedDict())
        for h in hashes:
            if h in mine:
                mine.move_to_end(h)
                continue
            mine[h] = None
            self._holders.setdefault(h, set()).add(replica)
            if len(mine) > self.capacity:
                old, _ = mine.popitem(last=False)
                self._drop(old, replica)

    def remove(self, replica: int, hashes: Iterable[bytes]) -> None:
        mine = self._by_replica.get(replica)
        if not mine:
            return
        for h in hashes:
            if h in mine:
                del mine[h]
                self._drop(h, replica)

    def _drop(self, h: bytes, replica: int) -> None:
        s = self._holders.get(h)
        if s is not None:
            s.discard(replica)
            if not s:
                del self._holders[h]

    def clear(self, replica: int) -> None:
        mine = self._by_replica.pop(replica, None)
        for h in mine or ():
            self._drop(h, replica)

    def replace(self, replica: int, hashes: Iterable[bytes]) -> None:
        self.clear(replica)
        self.add(replica, hashes)

    def size(self, replica: int | None = None) -> int:
        if replica is None:
            return len(self._holders)
        return len(self._by_replica.get(replica, ()))

    def match(self, hashes: Sequence[bytes], replicas: Iterable[int]) -> dict[int, int]:
        """For each replica: how many of the prompt's leading blocks it holds (consecutively)."""
        live = set(replicas)
        result = {r: 0 for r in live}
        cands = set(live)
        for depth, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            cands &= holders
            if not cands:
                break
            for r in cands:
                result[r] = depth + 1
        return result
