"""KV blocks out of one engine and into another (engine/kv/transfer.py): the second engine finds them in its
prefix cache, computes only the last partial block, and generates the same greedy tokens."""

from __future__ import annotations

import pytest

from flowrt.engine import LLM, KVTransfer, SamplingParams
from support import STORIES, make_tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPT = list(range(1, 100))   # 99 tokens: 6 full blocks of 16 and a partial one


def _llm(model=STORIES, **kw) -> LLM:
    return LLM(str(model), dtype="float32", num_kv_blocks=64, seed=0, **kw)


def _gen(llm: LLM, prompt=PROMPT) -> list[int]:
    return list(llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def test_exported_blocks_fill_a_fresh_engines_prefix_cache():
    a = _llm()
    want = _gen(a)
    blocks = a.engine.kv_export(PROMPT)
    assert len(blocks) == 6 and all(data for _, data in blocks)
    assert a.engine.kv_fingerprint() == a.engine.kv_fingerprint()
    skipped = a.engine.kv_export(PROMPT, skip=lambda h: h == blocks[0][0])
    assert skipped[0] == (blocks[0][0], None) and skipped[1:] == blocks[1:]

    b = _llm()
    assert b.engine.kv_fingerprint() == a.engine.kv_fingerprint()
    assert b.engine.kv_import(blocks) == 6
    assert b.engine.kv_import(blocks) == 0                      # already cached: kept as they are
    before = b.stats()["prefill_tokens_computed"]
    assert _gen(b) == want
    assert b.stats()["prefill_tokens_computed"] - before == len(PROMPT) - 6 * 16   # the partial block only
    b.engine.pool.check_invariants()


def test_export_ends_at_the_first_block_the_engine_lacks_and_import_checks_sizes():
    a = _llm()
    assert a.engine.kv_export(PROMPT) == []          # nothing computed yet
    _gen(a, PROMPT[:40])
    assert len(a.engine.kv_export(PROMPT)) == 2      # 2 full blocks of the first 40 tokens
    with pytest.raises(ValueError, match="bytes"):
        a.engine.kv_import([(b"x" * 16, b"short")])


def test_fingerprint_differs_with_weights_dtype_and_block_size(tmp_path):
    base = _llm().engine.kv_fingerprint()
    assert _llm(block_size=32).engine.kv_fingerprint() != base
    assert _llm(kv_cache_dtype="bfloat16").engine.kv_fingerprint() != base
    m1 = make_tiny_model(tmp_path / "m1", seed=1)
    m2 = make_tiny_model(tmp_path / "m2", seed=2)
    assert _llm(m1).engine.kv_fingerprint() != _llm(m2).engine.kv_fingerprint()


def test_async_engine_is_a_kv_transfer():
    from flowrt.engine import AsyncLLM

    eng = AsyncLLM(str(STORIES), dtype="float32", num_kv_blocks=16)
    try:
        assert isinstance(eng, KVTransfer)
    finally:
        eng.shutdown()


def test_import_into_a_small_pool_keeps_the_chains_first_blocks():
    a = _llm()
    _gen(a)
    blocks = a.engine.kv_export(PROMPT)
    small = LLM(str(STORIES), dtype="float32", num_kv_blocks=4, seed=0)
    assert small.engine.kv_import(blocks) == 4
    assert [small.engine.pool.lookup(h) is not None for h, _ in blocks] == [True] * 4 + [False] * 2
    small.engine.pool.check_invariants()
