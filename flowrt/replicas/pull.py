"""KV pulled between replicas: when the router sends a run away from the replica that holds its prefix (that one
is busy), the chosen replica copies the prefix's blocks from the holder (Ray's object store, so across nodes)
instead of computing them again, when the copy is cheaper than the prefill.

The decision is a cost estimate (``PullCost``): a pull costs a fixed round trip plus the bytes over the link,
a prefill costs the prefix's tokens at the replica's prefill rate. The defaults are measured on a 2-core Zen 3
with stories260K (``python bench/scaleout.py --crossover``: the round trip dominates there, so pulling wins from
about one block on); a bigger model raises both sides, the prefill far more (its compute grows with the
weights, its KV bytes only with layers x KV heads), so a pull pays off sooner still. Blocks only move between
replicas whose ``kv_fingerprint`` agree (same weights, dtype, block size, backend): the router checks it and the
source refuses a foreign one.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PullCost", "PullPlan"]


@dataclass
class PullCost:
    """What a pull and a prefill are estimated to cost (seconds); ``enabled=False`` never pulls."""

    rtt_s: float = 0.006                 # two actor calls (export on the holder, then import) on this machine
    bytes_per_s: float = 4e8             # object store copy, same machine (a network link: set it lower)
    prefill_tokens_per_s: float = 4000.0  # a replica's prefill rate (stories260K, 1 core, while it decodes others)
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
    """Copy the first ``blocks`` blocks of ``token_ids`` from replica ``source`` before the run's first request."""

    source: int
    blocks: int
