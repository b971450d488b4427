"""Speculative decoding from the context (n-gram prompt lookup): exact for greedy and sampled requests."""

import collections

import pytest
import torch

from support import hf_greedy, make_tiny_model
from flowrt.engine import LLM, SamplingParams
from flowrt.engine.kv.block_pool import BlockPool
from flowrt.engine.config import EngineArgs
from flowrt.engine.kv.cache_manager import KVCacheManager
from flowrt.engine.request.sequence import Request, SampleState, Sequence
from flowrt.engine.decoding.ngram_index import NgramIndex
from flowrt.engine.decoding.spec_decode import NgramSpeculator, SpeculativeConfig

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
STORY_PROMPTS = [
    "Once upon a time",
    "The little dog ran to the park and saw a big red ball. He",
    "Lily",
    "Tom had a toy car",
]


def run(model_dir, prompts, params, **kw):
    llm = LLM(model_dir, dtype="float32", **kw)
    outs = llm.generate(prompts, params)
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0, "blocks leaked"
    return outs, stats


def ngram_draft(tokens, k, n_min, n_max):
    index = NgramIndex(n_min, n_max)
    index.extend(tokens)
    s = index.find(tokens, n_max, n_min)
    return [] if s is None else tokens[s:s + k]


def test_ngram_draft_takes_what_followed_the_latest_match():
    toks = [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7]
    assert ngram_draft(toks, 3, 2, 4) == [2, 3, 5]  # "5 6 7" last seen followed by 2, 3, 5
    assert ngram_draft(toks, 10, 2, 4) == [2, 3, 5, 6, 7]
    assert ngram_draft([1, 2, 3, 4], 3, 2, 4) == []
    assert ngram_draft([1, 2, 1, 2], 3, 2, 2) == [1, 2]
    assert ngram_draft([4, 4], 3, 1, 1) == [4]


def test_config_is_checked():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=5, prompt_lookup_max=3)
    with pytest.raises(ValueError, match="method"):
        LLM(None, speculative_config={"method": "eagle"})


@pytest.mark.parametrize("field, bound", [("num_speculative_tokens", 32), ("prompt_lookup_min", 16),
                                          ("prompt_lookup_max", 16), ("suffix_cache_tokens", 1 << 18),
                                          ("fallback_tokens", 32)])
def test_sizes_are_bounded(field, bound):
    """Issue 39 item 10: prompt_lookup_max 100000 was accepted (each request then took seconds and RSS grew):
    every size is bounded, on the Python API and in --speculative-config's JSON, by an error naming it."""
    SpeculativeConfig(**{field: bound, "prompt_lookup_max": 16})   # the bound itself is allowed
    with pytest.raises(ValueError, match=rf"{field}\n.*less than or equal to {bound}"):
        SpeculativeConfig(**{field: bound + 1})
    with pytest.raises(ValueError, match=rf"speculative_config.{field}\n.*less than or equal to {bound}"):
        EngineArgs(speculative_config=f'{{"{field}": {max(bound + 1, 100000)}}}')


@pytest.mark.parametrize("engine_kw", [{}, {"max_num_batched_tokens": 7}, {"num_kv_blocks": 9, "block_size": 8}],
                         ids=["batched", "chunked", "preempt"])
def test_stories_greedy_identical_and_drafts_accepted(stories_path, engine_kw):
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    llm_tok = LLM(stories_path, dtype="float32").tokenizer
    ids = [{"prompt_token_ids": llm_tok(p).input_ids} for p in STORY_PROMPTS]
    off, _ = run(stories_path, ids, params, speculative_config=None, **engine_kw)
    on, stats = run(stories_path, ids, params, speculative_config=SPEC, **engine_kw)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert [o.outputs[0].text for o in on] == [o.outputs[0].text for o in off]
    assert stats["spec_accepted_tokens"] > 0 and stats["spec_draft_tokens"] > stats["spec_accepted_tokens"]
    if "num_kv_blocks" in engine_kw:
        assert stats["preemptions"] > 0


@pytest.mark.parametrize(
    "arch,tie", [("llama", True), ("llama", False), ("mistral", False), ("qwen2", True), ("qwen3", False)])
def test_architectures_match_transformers_with_speculation(tmp_path, arch, tie):
    model_dir = make_tiny_model(tmp_path / arch, arch=arch, tie=tie)
    ids = [[1, 5, 77, 300, 12, 9], [1, 400] + list(range(20, 60)), [1, 250]]
    ref = [hf_greedy(model_dir, p, 24) for p in ids]
    outs, stats = run(model_dir, [{"prompt_token_ids": p} for p in ids],
                      SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                      speculative_config=SPEC, max_num_batched_tokens=16, block_size=8)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert stats["spec_draft_tokens"] > 0


def test_stop_strings_logprobs_and_forks_unchanged(stories_path):
    """Tokens past a stop string are dropped as without drafts; logprobs of accepted drafts are their rows';
    forks (n > 1) draft from their own history."""
    params = [SamplingParams(max_tokens=60, temperature=0.0, stop=["Lily was"], logprobs=2),
              SamplingParams(max_tokens=40, temperature=0.0, n=2, logprobs=0)]
    prompts = [STORY_PROMPTS[0], STORY_PROMPTS[1]]
    off, _ = run(stories_path, prompts, params, speculative_config=None)
    on, stats = run(stories_path, prompts, params, speculative_config=SPEC)
    assert stats["spec_accepted_tokens"] > 0
    for a, b in zip(on, off):
        for x, y in zip(a.outputs, b.outputs):
            assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (y.token_ids, y.text, y.finish_reason,
                                                                              y.stop_reason)
            assert [sorted(e) for e in x.logprobs] == [sorted(e) for e in y.logprobs]
            for ex, ey in zip(x.logprobs, y.logprobs):
                for t in ex:
                    assert ex[t].logprob == pytest.approx(ey[t].logprob, abs=1e-4) and ex[t].rank == ey[t].rank


def test_seeded_sampling_is_reproducible(stories_path):
    params = SamplingParams(max_tokens=60, temperature=0.8, seed=123)
    a, stats = run(stories_path, STORY_PROMPTS[:2], params, speculative_config=SPEC)
    b, _ = run(stories_path, STORY_PROMPTS[:2], params, speculative_config=SPEC)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert stats["spec_draft_tokens"] > 0


def test_structured_forced_tokens_unchanged(stories_path):
    """A grammar that forces every other token (tests/engine/test_spec_structured.py: drafts under grammars)."""
    from flowrt.engine import StructuredOutputsParams

    params = SamplingParams(max_tokens=30, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(regex=r"(ab ){3,9}"))
    off, off_stats = run(stories_path, ["Say ab ab ab"], params, speculative_config=None)
    on, stats = run(stories_path, ["Say ab ab ab"], params, speculative_config=SPEC)
    assert on[0].outputs[0].token_ids == off[0].outputs[0].token_ids
    # drafts follow pending forced tokens, so a token forced later may come as an accepted draft instead
    assert 0 < stats["forced_tokens"] <= off_stats["forced_tokens"]


def _drafting_seq(drafts: list[int], params: SamplingParams) -> Sequence:
    """A sequence [1, 2, 3] (3 pending) with `drafts` appended, as propose() leaves it."""
    seq = Sequence([1, 2, 3] + drafts)
    seq.sample = SampleState(Request("r", params, None, [1, 2, 3], [seq]), prompt_len=3)
    seq.spec.num_draft_tokens = len(drafts)
    return seq


def test_sampled_verification_keeps_the_distribution():
    """On a 4-token vocabulary: the first emitted token is distributed as row 0's p, and the second (after an
    accepted first draft) as row 1's, whatever the drafts (chi-square, 5,000 draws, p ~ 1e-4 bound)."""
    kv = KVCacheManager(BlockPool(8), 4)
    spec = NgramSpeculator(SpeculativeConfig(), kv, 100)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.5, 1.5, 0.2], [1.0, 1.0, 1.0, 1.0]])
    p0, p1 = torch.softmax(logits[0], 0), torch.softmax(logits[1], 0)
    g = torch.Generator().manual_seed(0)
    N = 5_000
    params = SamplingParams(max_tokens=50, temperature=1.0)
    first, second = collections.Counter(), collections.Counter()
    for _ in range(N):
        seq = _drafting_seq([1, 2], params)
        bonus = int(torch.multinomial(torch.softmax(logits[2], 0), 1, generator=g))
        v = spec.verify(seq, logits.clone(), bonus, False, g)
        emitted = [*v.accepted, v.final]
        first[emitted[0]] += 1
        if emitted[0] == 1:
            second[emitted[1]] += 1
        assert seq.token_ids == [1, 2, 3] and seq.spec.num_draft_tokens == 0
    for counts, p in ((first, p0), (second, p1)):
        n = sum(counts.values())
        chi2 = sum((counts[t] - n * float(p[t])) ** 2 / (n * float(p[t])) for t in range(4))
        assert chi2 < 21.1, (counts, p)  # 3 degrees of freedom: P(chi2 > 21.1) ~ 1e-4
    assert spec.accepted_tokens > 0


def test_cli_flag_and_metrics(stories_path):
    import argparse
    import json

    from flowrt.runner.options import add_engine_arguments, engine_kwargs_from_args
    from flowrt.server.metrics import EngineCollector

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    kw = engine_kwargs_from_args(p.parse_args(["--speculative-config", json.dumps(SPEC)]))
    assert SpeculativeConfig(**kw["speculative_config"]) == SpeculativeConfig(**SPEC)
    llm = LLM(stories_path, dtype="float32", **kw)
    llm.generate(STORY_PROMPTS[0], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    st = llm.stats()
    assert st["spec_draft_tokens"] > 0
    assert st["spec_acceptance_rate"] == st["spec_accepted_tokens"] / st["spec_draft_tokens"]
    metrics = {m.name: m.samples[0].value for m in EngineCollector(llm.stats).collect()}
    assert metrics["flowrt_engine_spec_acceptance_rate"] == st["spec_acceptance_rate"]
    assert metrics["flowrt_engine_spec_draft_tokens"] == st["spec_draft_tokens"]
    assert metrics["flowrt_engine_spec_draft_rejected_by_grammar"] == st["spec_draft_rejected_by_grammar"] == 0
