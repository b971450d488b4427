"""Speculative decoding with structured output: drafts are cut where the grammar forbids them, each draft row is
checked under the grammar's mask after the drafts before it, and forced tokens still skip the model."""

import re

import pytest
import torch

from flowrt.engine import LLM, SamplingParams, StructuredOutputsParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
# The story told twice, then its start again: the n-gram drafter proposes its continuation ("... named Lily.
# She ..."), which the constraints below forbid from some point on (capitals, ".").
REPEATED = f"{STORY} {STORY} Once upon a time,"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "text": {"type": "string"}},
          "required": ["name", "text"]}
CONSTRAINED = [
    (REPEATED, StructuredOutputsParams(regex=r"[a-z ,]{1,80}")),
    (f"{STORY} One day, Lily went to the park. {STORY} One day,", StructuredOutputsParams(regex=r"( [a-z]+)+")),
    (REPEATED, StructuredOutputsParams(
        regex=r" there was a little (girl|boy) named [A-Z][a-z]+\. (He|She) [a-z ]{1,60}\.")),
    (f"{STORY} JSON: ", StructuredOutputsParams(json=SCHEMA)),
    (f"{STORY} {STORY} Once", StructuredOutputsParams(choice=[" upon a time, there was a little girl named Lily.",
                                                             " upon a time, there was a little boy named Tom."])),
    (f"{STORY} {STORY}", StructuredOutputsParams(grammar="start: SENT+\nSENT: /( [A-Za-z]+)+[.]/")),
]


def run(model, prompts, params, **kw):
    llm = LLM(model, dtype="float32", **kw)
    outs = llm.generate(prompts, params)
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0, "blocks leaked"
    return outs, stats


@pytest.mark.parametrize("engine_kw", [  # chunked prefill and preemption: slow (the fast tier tests them unconstrained)
    pytest.param({}, id="batched"),
    pytest.param({"max_num_batched_tokens": 24}, id="chunked", marks=pytest.mark.slow),
    pytest.param({"num_kv_blocks": 30, "block_size": 8}, id="preempt", marks=pytest.mark.slow),
])
def test_draft_tokens_rejected_by_a_constraint_greedy_identical(stories_path, engine_kw):
    """Constrained requests draft; drafted tokens their grammar forbids are cut (counted), and the greedy
    outputs (regex, json, choice, grammar, next to an unconstrained request and n=2) equal those without
    drafts, logprobs too. (Without the draft rows' masks, a draft row's unconstrained argmax is emitted and the grammar
    aborts the sample.)"""
    prompts = [p for p, _ in CONSTRAINED] + [REPEATED, REPEATED]
    params = [SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=so, logprobs=1 if i < 2 else None)
              for i, (_, so) in enumerate(CONSTRAINED)]
    params += [SamplingParams(max_tokens=40, temperature=0.0),
               SamplingParams(max_tokens=40, temperature=0.0, n=2, structured_outputs=CONSTRAINED[0][1])]
    off, off_stats = run(stories_path, prompts, params, speculative_config=None, **engine_kw)
    on, stats = run(stories_path, prompts, params, speculative_config=SPEC, **engine_kw)
    for a, b in zip(on, off):
        for x, y in zip(a.outputs, b.outputs):
            assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
            assert x.finish_reason != "abort"
            for ex, ey in zip(x.logprobs or [], y.logprobs or []):  # logprobs under the grammar's mask
                assert sorted(ex) == sorted(ey)
                assert all(ex[t].logprob == pytest.approx(ey[t].logprob, abs=1e-4) for t in ex)
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    assert stats["spec_draft_rejected_by_grammar"] > 0
    # forced tokens still skip the model (one drafted after earlier forced ones may come as an accepted draft)
    assert 0 < stats["forced_tokens"] <= off_stats["forced_tokens"]
    assert off_stats["spec_draft_rejected_by_grammar"] == 0
    if "num_kv_blocks" in engine_kw:
        assert stats["preemptions"] > 0


def test_regex_cuts_the_copied_continuation(stories_path):
    """One request: the prompt's continuation ("... named Lily. She") is what the drafter proposes, and the
    regex forbids its capitals and "."."""
    prompt, so = CONSTRAINED[0]
    params = SamplingParams(max_tokens=60, temperature=0.0, structured_outputs=so)
    off, _ = run(stories_path, prompt, params, speculative_config=None)
    on, stats = run(stories_path, prompt, params, speculative_config=SPEC)
    assert on[0].outputs[0].token_ids == off[0].outputs[0].token_ids
    assert re.fullmatch(so.regex, on[0].outputs[0].text)
    assert stats["spec_draft_tokens"] > 0 and stats["spec_draft_rejected_by_grammar"] > 0


def test_draft_masks_are_the_grammar_states_after_each_draft(stories_path):
    """apply_drafts masks row j by the matcher's state after j drafts (as consuming them one by one gives),
    the sample row's mask becomes the sequence's grammar_mask, and the matcher is left where it was."""
    from flowrt.engine.request.sequence import GrammarState, Sequence
    from flowrt.engine.decoding.structured_output import draft_prefix, unpack_mask

    llm = LLM(stories_path, dtype="float32")
    so = llm.engine.structured
    matcher = so.compile(StructuredOutputsParams(regex=r"(ab ){2}"))
    ab_ab = llm.tokenizer.convert_tokens_to_ids(["a", "b", "▁a", "b", "▁"])  # "ab ab "
    assert draft_prefix(matcher, ab_ab + ab_ab[:2]) == 5  # cut after the token that completes the grammar
    assert draft_prefix(matcher, ab_ab[:2] + ab_ab[:2]) == 2  # cut at a token the grammar forbids
    drafts = ab_ab  # the last row: the state after the grammar completed (EOS only)
    seq = Sequence([1, 7] + drafts)
    seq.grammar, seq.spec.num_draft_tokens = GrammarState(matcher), len(drafts)
    m = len(drafts)
    logits = torch.zeros(m + 3, 512)
    so.apply_drafts(logits, [(seq, 2, m)])
    ref = matcher.deep_copy()
    for j in range(m + 1):
        mask = torch.zeros((1, so.width), dtype=torch.int32)
        ref.unsafe_compute_mask_ptr(mask.data_ptr(), so.width * 4)
        allowed = unpack_mask(mask, 512)[0]
        assert torch.equal(logits[2 + j] == 0, allowed), j
        if j < m:
            assert ref.consume_token(drafts[j])
    assert torch.equal(seq.grammar.mask, mask[0])
    assert (logits[:2] == 0).all()  # other rows untouched
    assert draft_prefix(matcher, ab_ab) == 5 and not matcher.is_stopped()  # rolled back


def test_sampled_constrained_requests_valid_and_seeded(stories_path):
    """Sampled constrained requests with drafts: every output is one its grammar accepts (a complete one when
    it stopped), and a seed gives the same tokens run after run."""
    picked = [CONSTRAINED[i] for i in (0, 1, 3, 5)]
    prompts = [p for p, _ in picked]
    params = [SamplingParams(max_tokens=60, temperature=0.7, top_p=0.95, seed=7 + i, structured_outputs=so)
              for i, (_, so) in enumerate(picked)]
    a, stats = run(stories_path, prompts, params, speculative_config=SPEC)
    b, _ = run(stories_path, prompts, params, speculative_config=SPEC)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    structured = LLM(stories_path, dtype="float32").engine.structured
    for o, (_, so) in zip(a, picked):
        co = o.outputs[0]
        assert co.finish_reason in ("stop", "length")
        matcher = structured.compile(so)
        assert matcher.consume_tokens(co.token_ids), (co.text, matcher.get_error())
        assert co.finish_reason == "length" or matcher.is_accepting()


def test_sampled_verification_keeps_the_constrained_distribution(stories_path):
    """The accept/reject rule on rows masked by apply_drafts: the first emitted token is distributed as the
    grammar-masked p of row 0, whatever the (allowed) draft (chi-square over the allowed tokens, 2,000 draws)."""
    import collections

    from flowrt.engine.kv.block_pool import BlockPool
    from flowrt.engine.kv.cache_manager import KVCacheManager
    from flowrt.engine.request.sequence import GrammarState, Request, SampleState, Sequence
    from flowrt.engine.decoding.spec_decode import NgramSpeculator, SpeculativeConfig

    llm = LLM(stories_path, dtype="float32")
    matcher = llm.engine.structured.compile(StructuredOutputsParams(regex=r"(a|b|c|ab)(a|b|c)"))
    a, b = llm.tokenizer.convert_tokens_to_ids(["a", "b"])
    params = SamplingParams(max_tokens=50, temperature=1.0)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 512, generator=g)
    logits[0, a] -= 1.0  # the draft is allowed, and not row 0's most likely token
    seq = Sequence([1, 2, 3, a, b])
    seq.sample = SampleState(Request("r", params, None, [1, 2, 3], [seq]), prompt_len=3)
    seq.grammar, seq.spec.num_draft_tokens = GrammarState(matcher), 2
    llm.engine.structured.apply_drafts(logits, [(seq, 0, 2)])
    p0 = torch.softmax(logits[0], 0)
    allowed = p0.nonzero().flatten().tolist()
    assert a in allowed and 1 < len(allowed) < 20
    spec = NgramSpeculator(SpeculativeConfig(), KVCacheManager(BlockPool(8), 4), 100)
    counts = collections.Counter()
    N = 2_000
    for _ in range(N):
        seq.token_ids[3:] = [a, b]
        seq.spec.num_draft_tokens = 2
        v = spec.verify(seq, logits, b, False, g)  # (the last row's sample: not the first token's business)
        counts[[*v.accepted, v.final][0]] += 1
    assert set(counts) <= set(allowed)
    chi2 = sum((counts[t] - N * float(p0[t])) ** 2 / (N * float(p0[t])) for t in allowed)
    k = len(allowed) - 1  # P(chi2 > bound) ~ 1e-4 (Wilson-Hilferty: z = 3.72)
    bound = k * (1 - 2 / (9 * k) + 3.72 * (2 / (9 * k)) ** 0.5) ** 3
    assert chi2 < bound, (counts, p0[allowed])


def test_sequences_with_pending_forced_tokens_draft(stories_path, monkeypatch):
    """A sequence whose grammar forced tokens (not yet computed) drafts after them; outputs equal those without
    drafts. (The choice grammar forces the rest of the option once its first word decides it.)"""
    from flowrt.engine.decoding.spec_decode import NgramSpeculator

    seen = []
    propose = NgramSpeculator.propose

    def spy(self, running):
        propose(self, running)
        for s in running:
            m = s.spec.num_draft_tokens
            if m and s.num_tokens - m - s.kv.num_computed_tokens > 1:
                seen.append(m)

    monkeypatch.setattr(NgramSpeculator, "propose", spy)
    prompts = [f"{STORY} {STORY} Once", REPEATED, f"{STORY} JSON: "]
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=so)
              for so in (CONSTRAINED[4][1], StructuredOutputsParams(regex=r"( there was a little girl named Lily\.)"
                                                                          r"( She [a-z ]+\.)"),
                         CONSTRAINED[3][1])]
    off, off_stats = run(stories_path, prompts, params, speculative_config=None)
    on, stats = run(stories_path, prompts, params, speculative_config={**SPEC, "adaptive": False})
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    # (a token the grammar would force later may come as an accepted draft instead)
    assert 0 < stats["forced_tokens"] <= off_stats["forced_tokens"]
    assert seen, "no sequence with pending forced tokens drafted"
