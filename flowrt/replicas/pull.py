"""KV pulled between replicas: when the router sends a run away from the replica that holds its prefix (that one
is busy), the chosen replica copies the prefix's blocks from the holder (Ray's object store, so across nodes)
instead of computing them again, when the copy is cheaper than the prefill.

The decision is a cost estimate (``PullCost``): a pull costs one more actor round trip (the holder's export)
plus the bytes over the link, a prefill costs the prefix's tokens at the replica's prefill rate. The defaults
are fitted to ``python bench/scaleout.py --crossover`` on a 2-core Zen 3 (busy with other work) with stories260K
(20 KiB blocks of 16 tokens), medians of 5, pull vs prefill of the same blocks on another node: 1 block 7.4 vs
7.5 ms, 2 blocks 6.1 vs 7.8, 4 blocks 8.0 vs 9.0, 16 blocks 16 vs 20, 24 blocks 19 vs 47: both pay the call's
~6 ms, a pulled block ~0.5 ms more (Python-level copies, ~40 MB/s), a prefilled token ~0.11 ms (~9k tokens/s),
so pulling wins from about 2 blocks. A bigger model moves the crossover lower still: its prefill per token
grows with all the weights, its KV bytes only with layers x KV heads. Blocks only move between replicas whose
``kv_fingerprint`` agree (same weights, dtype, block size, backend): the router checks it and the source
refuses a foreign one.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PullCost", "PullPlan"]


@dataclass
class PullCost:
    """What a pull and a prefill are estimated to cost (seconds); ``enabled=False`` never pulls."""

    rtt_s: float = 0.002                 # the holder's export call, beyond the call the request makes anyway
    bytes_per_s: float = 4e7             # export + object store + import, per block's bytes (measured, above)
    prefill_tokens_per_s: float = 9000.0  # a replica's prefill rate (stories260K, 1 core: set yours)
    enabled: bool = True

    def pull_s(self, blocks: int, block_bytes: int) -> float:
        return self.rtt_s + blocks * block_bytes / self.bytes_per_s

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def worth_it(self, blocks: int, block_size: int, block_bytes: int) -> bool:
        """Pull ``blocks`` blocks rather than compute their tokens."""
        return self.enabled and blocks > 0 and self.pull_s(blocks, block_bytes) < self.prefill_s(blocks * block_size)


@dataclass
class PullPlan:
    """Copy the first ``blocks`` blocks of ``token_ids`` from replica ``source`` before the run's first request,
    waiting up to ``wait_s`` for those the source is still computing (about their prefill time: no longer than
    computing them here would take)."""

    source: int
    blocks: int
    wait_s: float = 0.0
