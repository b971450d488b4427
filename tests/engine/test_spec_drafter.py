"""What speculative decoding proposes (engine/decoding/ngram_index.py, NgramSpeculator._draft): the incremental n-gram
index,
the suffix cache of earlier outputs, the one-token fallback. Verification is unchanged: outputs stay identical."""

import random

import numpy as np
import torch

from flowrt.engine import LLM, SamplingParams
from flowrt.engine.kv.block_pool import BlockPool
from flowrt.engine.kv.cache_manager import KVCacheManager
from flowrt.engine.decoding.ngram_index import NgramIndex, SuffixCache
from flowrt.engine.request.sequence import Request, SampleState, Sequence
from flowrt.engine.decoding.spec_decode import NgramSpeculator, SpeculativeConfig
from flowrt.engine.decoding.spec_policy import DraftBudget


def ngram_draft(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The reference the index must agree with (the scan the engine used before it): the (up to) k tokens that
    followed the latest earlier occurrence of the longest suffix of `tokens` of
    n_min..n_max tokens; [] if none occurred."""
    L = len(tokens)
    if L <= n_min:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = arr[L - n:]
        # candidate starts i < L - n whose n tokens equal the suffix (the suffix itself excluded)
        hits = np.flatnonzero(arr[: L - n] == suffix[0])
        for j in range(1, n):
            if not len(hits):
                break
            hits = hits[arr[np.minimum(hits + j, L - 1)] == suffix[j]]
        hits = hits[hits + n < L]
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k]
    return []


def test_index_finds_what_the_scan_finds():
    """Grown in random chunks, the index proposes exactly what ngram_draft's scan of the whole list does."""
    rng = random.Random(0)
    for trial in range(200):
        vocab = rng.choice([2, 3, 5, 20])
        n_min = rng.randint(1, 3)
        n_max = rng.randint(n_min, 5)
        index = NgramIndex(n_min, n_max)
        tokens: list[int] = []
        while len(tokens) < 120:
            tokens += [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
            index.extend(tokens)
            s = index.find(tokens, n_max, n_min)
            for k in (1, 4):
                assert (tokens[s:s + k] if s is not None else []) == ngram_draft(tokens, k, n_min, n_max), trial


def test_index_reindexes_a_list_that_is_not_the_indexed_one_grown():
    index = NgramIndex(1, 2)
    index.extend([1, 2, 3, 1, 2])
    assert index.find([1, 2, 3, 1, 2], 2, 1) == 2
    index.extend([7, 8, 7])  # another list: nothing of [1, 2, 3, ...] may be proposed
    assert index.find([7, 8, 7], 2, 1) == 1
    assert index.find([1, 2], 2, 1) is None
    index.extend([7, 8])  # cut short
    assert index.find([7, 8], 2, 1) is None


def test_suffix_cache_drafts_from_earlier_outputs_and_forgets_the_oldest():
    cache = SuffixCache(max_tokens=12, n_min=2, n_max=3)
    cache.add([10, 11, 12, 13, 14])
    assert cache.draft([99, 11, 12], 2) == [13, 14]
    assert cache.draft([99, 13, 14], 4) == []  # the output ended there: nothing crosses into the next one
    assert cache.draft([99, 12], 4) == []  # shorter than prompt_lookup_min
    cache.add([20, 11, 12, 30])  # the latest occurrence wins
    assert cache.draft([5, 11, 12], 4) == [30]
    cache.add([40, 41, 42, 43])  # past 12 tokens: the older half goes
    assert len(cache.tokens) <= 12
    assert cache.draft([5, 13, 14], 4) == [] and cache.draft([41, 42], 4) == [43]


def _seq(tokens: list[int], prompt_len: int) -> Sequence:
    seq = Sequence(list(tokens))
    seq.sample = SampleState(Request("r", SamplingParams(max_tokens=50, temperature=0.0), None, tokens[:prompt_len],
                                     [seq]), prompt_len=prompt_len)
    seq.kv.num_computed_tokens = len(tokens) - 1
    return seq


def test_drafts_come_from_the_context_then_the_suffix_cache_then_one_token():
    kv = KVCacheManager(BlockPool(64), 4)
    spec = NgramSpeculator(SpeculativeConfig(num_speculative_tokens=4, fallback_tokens=2), kv, 1000)
    ctx = _seq([5, 6, 7, 1, 5, 6], 3)
    assert spec._draft(ctx, fallback=True)[0] == [7, 1, 5, 6]  # "5 6" in its own tokens
    spec.suffix.add([8, 3, 4, 2, 2, 2])
    cached = _seq([9, 1, 9, 3, 4], 2)
    assert spec._draft(cached, fallback=True) == ([2, 2, 2], "suffix")  # "3 4" only in an earlier output
    alone = _seq([9, 1, 2, 3, 9], 2)
    assert spec._draft(alone, fallback=True) == ([1, 2], "fallback")  # "9" alone, at most fallback_tokens
    assert spec._draft(alone, fallback=False)[0] == []
    seeded = _seq([9, 1, 9, 3, 4], 2)
    seeded.sample.request.params = SamplingParams(max_tokens=50, temperature=1.0, seed=1)
    seeded.sample.generator = torch.Generator().manual_seed(1)
    assert spec._draft(seeded, fallback=True)[0] == []  # its own tokens only: draws reproducible by seed
    off = NgramSpeculator(SpeculativeConfig(suffix_cache_tokens=0, fallback_tokens=0), kv, 1000)
    assert off.suffix is None and off._draft(cached, fallback=True)[0] == []


def test_fallback_only_where_a_row_is_cheap():
    budget = DraftBudget()
    for _ in range(20):  # rows cost 1/10 of a step's fixed part
        for rows in (1, 9):
            budget.cost.observe(rows, 0.01 + 0.001 * rows)
    assert budget.pays(0.2, 1, 1)  # one sequence: a row costs 10% of its step
    assert not budget.pays(0.2, 32, 32)  # 32 sequences: a row costs 1/42 of a step that makes 32 tokens
    assert not budget.pays(0.2, 20, 1)  # a prefill chunk runs


def test_finished_outputs_feed_the_suffix_cache_and_outputs_stay_identical(stories_path):
    """The second request drafts from the first one's output (more accepted than from its own context alone);
    tokens are those of decoding without speculation."""
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompts = ["Once upon a time", "Once upon a time, there was"]
    base = {"method": "ngram", "num_speculative_tokens": 8, "adaptive": False}
    off = LLM(stories_path, dtype="float32", speculative_config=None).generate(prompts, params)
    accepted = {}
    for cache in (0, 4096):
        llm = LLM(stories_path, dtype="float32", speculative_config={**base, "suffix_cache_tokens": cache})
        first = llm.generate(prompts[0], params)
        before = llm.stats()["spec_accepted_tokens"]
        second = llm.generate(prompts[1], params)
        accepted[cache] = llm.stats()["spec_accepted_tokens"] - before
        assert [first[0].outputs[0].token_ids, second[0].outputs[0].token_ids] == [o.outputs[0].token_ids
                                                                                 for o in off]
        spec = llm.engine.spec
        if not cache:
            assert spec.suffix is None
        else:  # the first output and its separator (the second joins at the next step)
            assert len(spec.suffix.tokens) == 49
            spec.forget_outputs()
            assert spec.suffix.tokens == []
    assert accepted[4096] > accepted[0]
