"""Per-sequence KV bookkeeping on top of the block pool: prefix matching, slot allocation with
copy-on-write, forking and release. Knows blocks and token ids, never tensors.

The only writer of a sequence's KV state (`seq.kv`, engine/request/sequence.py's KVState): the scheduler, speculative
decoding and the output processor change it through these methods."""

from __future__ import annotations

from dataclasses import dataclass, field

from .block_pool import BlockPool, hash_block
from ..request.sequence import KVState, Sequence


@dataclass
class KVStats:
    prefix_cache_queries: int = 0  # sequences that looked up the prefix cache
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    cow_copies: int = 0
    prefill_tokens_recomputed: int = 0  # tokens whose KV this engine had computed before, computed again
    # dropped KV blocks (evicted, or released by an idle/preempted sequence) needed again
    kv_evicted_in_use_later: int = 0


@dataclass
class SlotPlan:
    """What one allocate_slots call did: block copies the runner must perform before writing."""

    copies: list[tuple[int, int]] = field(default_factory=list)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self.stats = KVStats()

    # ---- hashing -------------------------------------------------------------------------------
    def _ensure_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        bs = self.block_size
        hashes = seq.kv.block_hashes
        for i in range(len(hashes), num_full_blocks):
            hashes.append(hash_block(hashes[i - 1] if i else None, seq.token_ids[i * bs : (i + 1) * bs]))

    # ---- prefix cache ----------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Extend seq's blocks with cached full blocks that continue its computed prefix.

        Only applies where the computed prefix ends on a block boundary. At least one token is always
        left to compute (its logits are needed). Returns the number of tokens found in the cache.
        """
        if not self.pool.enable_prefix_caching:
            return 0
        bs = self.block_size
        start = len(seq.kv.block_table)
        if seq.kv.num_computed_tokens != start * bs:
            return 0
        max_blocks = (seq.num_tokens - 1) // bs
        if max_blocks <= start:
            return 0
        self._ensure_hashes(seq, max_blocks)
        self.stats.prefix_cache_queries += 1
        self.stats.prefix_cache_query_tokens += seq.num_tokens - seq.kv.num_computed_tokens
        hits = 0
        for i in range(start, max_blocks):
            bid = self.pool.lookup(seq.kv.block_hashes[i])
            if bid is None:
                break
            self.pool.incref(bid)
            seq.kv.block_table.append(bid)
            hits += 1
        if hits:
            seq.kv.num_computed_tokens += hits * bs
            seq.kv.num_registered_blocks = len(seq.kv.block_table)
            self.stats.prefix_cache_hit_tokens += hits * bs
        return hits * bs

    def first_missing_hash(self, seq: Sequence) -> bytes | None:
        """Hash of the first full block that match_prefix would not find in the cache (None if none)."""
        if not self.pool.enable_prefix_caching:
            return None
        bs = self.block_size
        start = len(seq.kv.block_table)
        if seq.kv.num_computed_tokens != start * bs:
            return None
        max_blocks = (seq.num_tokens - 1) // bs
        self._ensure_hashes(seq, max_blocks)
        for i in range(start, max_blocks):
            if self.pool.lookup(seq.kv.block_hashes[i]) is None:
                return seq.kv.block_hashes[i]
        return None

    def cached_prefix_hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of the cached full blocks that match_prefix would find for seq now (none if it cannot)."""
        if not self.pool.enable_prefix_caching:
            return []
        bs = self.block_size
        start = len(seq.kv.block_table)
        if seq.kv.num_computed_tokens != start * bs:
            return []
        max_blocks = (seq.num_tokens - 1) // bs
        if max_blocks <= start:
            return []
        self._ensure_hashes(seq, max_blocks)
        out = []
        for i in range(start, max_blocks):
            h = seq.kv.block_hashes[i]
            if h not in self.pool.cached:
                break
            out.append(h)
        return out

    def mark_computed(self, seq: Sequence, n: int, unverified: int = 0) -> int:
        """After a step: seq's next n tokens are computed; the newly full blocks of all but the last `unverified`
        computed tokens (speculative drafts) enter the prefix cache. Returns (and counts) how many of the n this
        engine had computed before (below seq's high-water mark, or in a full block evicted from the cache)."""
        kv = seq.kv
        recomputed = self._account_computed(seq, kv.num_computed_tokens, n)
        kv.num_computed_tokens += n
        self.register_full_blocks(seq, kv.num_computed_tokens - unverified)
        return recomputed

    def _account_computed(self, seq: Sequence, c0: int, n: int) -> int:
        """Tokens [c0, c0 + n) of seq were just computed: returns (and counts) how many of them this engine
        had computed before (below seq's high-water mark, or in a full block evicted from the cache)."""
        bs = self.block_size
        end = c0 + n
        hw = seq.kv.max_computed_tokens
        top = min(end, hw)
        recomputed = max(0, top - c0)
        blocks = (top - 1) // bs - c0 // bs + 1 if recomputed else 0
        evicted = self.pool.evicted_hashes
        if evicted and end > hw:
            lo = max(c0, hw)
            full = end // bs
            self._ensure_hashes(seq, full)
            for i in range(lo // bs, full):
                h = seq.kv.block_hashes[i]
                if h in evicted:
                    del evicted[h]
                    recomputed += min(end, (i + 1) * bs) - max(lo, i * bs)
                    blocks += 1
        if end > hw:
            seq.kv.max_computed_tokens = end
        if recomputed:
            self.stats.prefill_tokens_recomputed += recomputed
            self.stats.kv_evicted_in_use_later += blocks
        return recomputed

    def uncomputed_full_hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of the full blocks this sequence has yet to compute (work in flight)."""
        bs = self.block_size
        full = seq.num_tokens // bs
        first = seq.kv.num_computed_tokens // bs
        if first >= full:
            return []
        self._ensure_hashes(seq, full)
        return seq.kv.block_hashes[first:full]

    def register_full_blocks(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """After a step: make newly completed full blocks (of the first `num_tokens` computed tokens: all
        by default) findable by later requests."""
        if not self.pool.enable_prefix_caching:
            return
        full = (seq.kv.num_computed_tokens if num_tokens is None else num_tokens) // self.block_size
        if full <= seq.kv.num_registered_blocks:
            return
        self._ensure_hashes(seq, full)
        for i in range(seq.kv.num_registered_blocks, full):
            self.pool.register(seq.kv.block_table[i], seq.kv.block_hashes[i])
        seq.kv.num_registered_blocks = full

    # ---- allocation -------------------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        bs = self.block_size
        kv = seq.kv
        table = kv.block_table
        first = kv.num_computed_tokens // bs
        last = (kv.num_computed_tokens + num_new_tokens - 1) // bs
        need = max(0, last + 1 - len(table))
        for i in range(first, min(last + 1, len(table))):
            if self.pool.blocks[table[i]].ref_count > 1:
                need += 1  # copy-on-write
        return need

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, plan: SlotPlan) -> bool:
        """Make the blocks for positions [computed, computed + n) writable by seq alone.

        Shared blocks in that range are copied first (copy-on-write; the copy is appended to
        plan.copies for the runner). Returns False, changing nothing, when the pool is short.
        """
        if self.blocks_needed(seq, num_new_tokens) > self.pool.num_free:
            return False
        bs = self.block_size
        kv = seq.kv
        first = kv.num_computed_tokens // bs
        last = (kv.num_computed_tokens + num_new_tokens - 1) // bs
        table = kv.block_table
        for i in range(first, min(last + 1, len(table))):
            old = table[i]
            if self.pool.blocks[old].ref_count > 1:
                new = self.pool.allocate()
                plan.copies.append((old, new))
                self.pool.decref(old)
                table[i] = new
                self.stats.cow_copies += 1
                if i < kv.num_registered_blocks:  # the copy is ours; the original stays cached
                    kv.num_registered_blocks = i
        while len(table) <= last:
            table.append(self.pool.allocate())
        return True

    def fork(self, seq: Sequence, child: Sequence) -> None:
        """child shares every block of seq (refcounts raised); nothing is copied or recomputed."""
        kv = seq.kv
        for bid in kv.block_table:
            self.pool.incref(bid)
        child.kv = KVState(list(kv.block_table), kv.num_computed_tokens, list(kv.block_hashes),
                           kv.num_registered_blocks, kv.max_computed_tokens)

    def free(self, seq: Sequence, low_priority: bool = False) -> None:
        """Release seq's blocks, tail first, so a chain's tail is evicted before its head.

        Its tokens stay; its KV is recomputed (or found in the prefix cache) when next needed.
        `low_priority`: its cached blocks are evicted before other cached blocks (a closed thread's).
        """
        kv = seq.kv
        for bid in reversed(kv.block_table):
            self.pool.decref(bid, low_priority)
        kv.block_table = []
        kv.num_computed_tokens = 0
        kv.num_registered_blocks = 0

    def forget_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """seq's tokens past `num_tokens` were removed or replaced (dropped drafts, a beam's own last token):
        the hashes of blocks that reached them are no longer its content."""
        del seq.kv.block_hashes[num_tokens // self.block_size:]

    def truncate_computed(self, seq: Sequence, num_tokens: int) -> None:
        """Forget KV past num_tokens (it will be recomputed); blocks past it are released."""
        if num_tokens >= seq.kv.num_computed_tokens:
            return
        keep = (num_tokens + self.block_size - 1) // self.block_size
        for bid in reversed(seq.kv.block_table[keep:]):
            self.pool.decref(bid)
        del seq.kv.block_table[keep:]
        seq.kv.num_computed_tokens = num_tokens
        seq.kv.max_computed_tokens = min(seq.kv.max_computed_tokens, num_tokens)  # a deliberate recompute
        seq.kv.num_registered_blocks = min(seq.kv.num_registered_blocks, num_tokens // self.block_size)
