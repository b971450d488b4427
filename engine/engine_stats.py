"""The counters ``LLMEngine.stats()`` reports (``llm.stats()``): KV blocks and the prefix cache, requests,
speculation, threads and the resident weights. Read under the engine's lock."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .llm_engine import LLMEngine

__all__ = ["engine_stats"]


def engine_stats(engine: LLMEngine) -> dict[str, Any]:
    pool, kvs = engine.pool, engine.kv_manager.stats
    spec, threads = engine.spec, engine.threads
    return {
        "num_kv_blocks": pool.num_blocks,
        "kv_blocks_used": pool.num_used,
        "kv_blocks_peak": pool.peak_used,
        "kv_blocks_shared": pool.num_shared,
        "kv_blocks_cached": len(pool.cached),
        "block_size": engine.block_size,
        **engine.counters,
        "preemptions": engine.scheduler.preemptions,
        "prefix_cache_hit_tokens": kvs.prefix_cache_hit_tokens,
        "prefix_cache_queries": kvs.prefix_cache_queries,
        "prefix_cache_query_tokens": kvs.prefix_cache_query_tokens,
        "cow_copies": kvs.cow_copies,
        "evictions": pool.evictions,
        "num_running": len(engine.scheduler.running),
        "num_waiting": len(engine.scheduler.waiting),
        "open_sequences": len(engine.open_seqs),
        "prefill_tokens_recomputed": kvs.prefill_tokens_recomputed,
        "kv_evicted_in_use_later": kvs.kv_evicted_in_use_later,
        "program_runs": len(engine.scheduler.tracker.runs),
        "beam_peak_blocks": engine.beam_peak_blocks,
        "spec_draft_tokens": spec.draft_tokens if spec is not None else 0,
        "spec_accepted_tokens": spec.accepted_tokens if spec is not None else 0,
        "spec_acceptance_rate": spec.acceptance_rate if spec is not None else 0.0,
        "spec_draft_rejected_by_grammar": spec.grammar_rejected_tokens if spec is not None else 0,
        "cpu_threads": threads.threads if threads is not None else torch.get_num_threads(),
        "cpu_thread_changes": threads.changes if threads is not None else 0,
        "weights_bytes": engine.weights.bytes,
        "weights_formats": dict(engine.weights.formats),
    }
