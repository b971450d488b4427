"""Prefix caching, copy-on-write forks, parallel sampling and open sequences (issue: shared KV)."""

import math

import pytest

from support import hf_greedy
from flowrt.engine import LLM, LLMEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(stories_path):
    return LLM(stories_path, dtype="float32", block_size=16)


def prefix_prompts(n=6, prefix_len=100, seed=0):
    import random

    rng = random.Random(seed)
    prefix = [1] + [rng.randrange(3, 512) for _ in range(prefix_len - 1)]
    return [prefix + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 30))] for _ in range(n)]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_greedy_identical_with_and_without_prefix_caching(stories_path):
    prompts = [{"prompt_token_ids": p} for p in prefix_prompts()]
    on = LLM(stories_path, dtype="float32", enable_prefix_caching=True)
    off = LLM(stories_path, dtype="float32", enable_prefix_caching=False)
    first = tokens(on.generate(prompts[:1], GREEDY))  # warms the cache with the shared prefix
    got_on = tokens(on.generate(prompts, GREEDY))
    got_off = tokens(off.generate(prompts, GREEDY))
    assert got_on == got_off
    assert got_on[0] == first[0]
    assert on.stats()["prefix_cache_hit_tokens"] > 0
    assert off.stats()["prefix_cache_hit_tokens"] == 0
    # one at a time, in other orders and batch compositions: same tokens
    one_by_one = [tokens(on.generate([p], GREEDY))[0] for p in reversed(prompts)]
    assert one_by_one[::-1] == got_on
    assert tokens(off.generate(prompts[::2], GREEDY)) == got_on[::2]


@pytest.mark.slow
def test_common_prefix_computed_once(stories_path):
    llm = LLM(stories_path, dtype="float32", max_num_batched_tokens=4096)
    prompts = prefix_prompts(n=8, prefix_len=160)
    ref = [hf_greedy(stories_path, p, 8) for p in prompts[:2]]
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=1, temperature=0))
    before = llm.stats()["prefill_tokens_computed"]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert tokens(outs)[:2] == ref
    computed = llm.stats()["prefill_tokens_computed"] - before
    own = sum(len(p) - 160 for p in prompts)
    # the 160-token prefix (10 full blocks) is never recomputed: only the suffixes
    assert computed <= own + 16
    assert llm.stats()["kv_blocks_used"] == 0


def test_many_requests_share_a_512_token_prefix_computed_once(stories_path):
    llm = LLM(stories_path, dtype="float32", max_model_len=512, max_num_batched_tokens=8192)
    import random

    rng = random.Random(1)
    prefix = [1] + [rng.randrange(3, 512) for _ in range(447)]  # 448 = 28 blocks, leaves room in 512 context
    prompts = [prefix + [rng.randrange(3, 512) for _ in range(32)] for _ in range(16)]
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    s = llm.stats()
    # All 16 arrive in one step: the first computes the prefix; the rest share it as it is registered.
    assert s["prefill_tokens_computed"] < 448 + 16 * (32 + 16)
    assert s["prefix_cache_hit_tokens"] >= 448 * 14


def test_parallel_sampling_prefills_once_and_shares_blocks(stories_path):
    llm = LLM(stories_path, dtype="float32", speculative_config=None)  # exact counts: no rejected drafts computed
    prompt = prefix_prompts(n=1, prefix_len=200)[0]
    new = 40
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(n=8, max_tokens=new, temperature=0.8, seed=7, ignore_eos=True))[0]
    s = llm.stats()
    assert len(out.outputs) == 8 and all(len(o.token_ids) == new for o in out.outputs)
    assert [o.index for o in out.outputs] == list(range(8))
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1, "samples should differ"
    assert s["prefill_tokens_computed"] == len(prompt)  # the prompt once, not 8 times
    assert s["decode_tokens_computed"] == 8 * (new - 1)
    bound = math.ceil(len(prompt) / 16) + 8 * math.ceil(new / 16) + 8
    assert s["kv_blocks_peak"] <= bound, (s["kv_blocks_peak"], bound)
    assert s["cow_copies"] >= 7
    assert s["kv_blocks_used"] == 0
    # seed + index streams: the same request again gives the same samples
    again = llm.generate([{"prompt_token_ids": prompt}],
                         SamplingParams(n=8, max_tokens=new, temperature=0.8, seed=7, ignore_eos=True))[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]


def test_greedy_n_samples_equal_single_greedy(llm):
    prompt = {"prompt_token_ids": prefix_prompts(n=1, prefix_len=37)[0]}
    single = tokens(llm.generate([prompt], GREEDY))[0]
    multi = llm.generate([prompt], GREEDY.model_copy(update={"n": 3}))[0]
    assert [o.token_ids for o in multi.outputs] == [single] * 3


def test_open_sequences_keep_kv_and_fork_copy_on_write(stories_path):
    eng = LLMEngine(model=stories_path, dtype="float32", speculative_config=None)  # exact counts: no rejected drafts
    prompt = prefix_prompts(n=1, prefix_len=40)[0]
    ref = hf_greedy(stories_path, prompt, 30)

    def run(seq, params):
        req = eng.add_request(seq, params)
        while not req.finished:
            eng.step()
        return eng.make_output(req)

    seq = eng.open(prompt)
    out1 = run(seq, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert out1.outputs[0].token_ids == ref[:10]
    assert seq.token_ids == prompt + ref[:10]
    computed = eng.stats()["prefill_tokens_computed"]
    decoded = eng.stats()["decode_tokens_computed"]
    children = eng.fork(seq, 3)
    assert eng.stats()["kv_blocks_shared"] > 0
    outs = [run(c, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)) for c in children]
    for o in outs:
        assert o.outputs[0].token_ids == ref[10:30]
    # each child computed only the parent's last token (not yet in KV) and its own new tokens
    assert eng.stats()["prefill_tokens_computed"] - computed == 3 * 1
    assert eng.stats()["decode_tokens_computed"] - decoded == 3 * 19
    assert eng.stats()["cow_copies"] >= 2
    # appending text is prefilled lazily by the next generate
    eng.append(seq, [5, 6, 7])
    run(seq, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    for s in [seq, *children]:
        eng.close(s)
    st = eng.stats()
    assert st["kv_blocks_used"] == 0 and st["open_sequences"] == 0
    eng.pool.check_invariants()


def test_prompt_logprobs_on_a_sequence_score_pending_tokens(stories_path):
    eng = LLMEngine(model=stories_path, dtype="float32", speculative_config=None)  # exact counts: no rejected drafts
    base = eng.tokenize("Once upon a time, there was a")
    seq = eng.open(base)
    req = eng.add_request(seq, SamplingParams(max_tokens=0))
    while not req.finished:
        eng.step()
    scores = {}
    for word in [" little", " big", " dog"]:
        child = eng.fork(seq, 1)[0]
        opt = eng.tokenize("a" + word)[2:]  # tokens of the word in context (after "a")
        eng.append(child, opt)
        r = eng.add_request(child, SamplingParams(max_tokens=0, prompt_logprobs=0))
        while not r.finished:
            eng.step()
        out = eng.make_output(r)
        assert len(out.prompt_logprobs) == len(opt)
        scores[word] = sum(d[t].logprob for d, t in zip(out.prompt_logprobs, opt))
        eng.close(child)
    # the model's own greedy continuation is " little"
    assert max(scores, key=scores.get) == " little"
    eng.close(seq)
    assert eng.stats()["kv_blocks_used"] == 0


def test_idle_open_sequences_yield_blocks_before_preemption(stories_path):
    eng = LLMEngine(model=stories_path, dtype="float32", num_kv_blocks=12, block_size=8)
    idle = []
    for i in range(3):
        s = eng.open([1] + [10 + i] * 30)
        r = eng.add_request(s, SamplingParams(max_tokens=1, temperature=0))
        while not r.finished:
            eng.step()
        idle.append(s)
    assert eng.stats()["kv_blocks_used"] == 12
    req = eng.add_request({"prompt_token_ids": [1] + [99] * 40},
                          SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    while not req.finished:
        eng.step()
    assert eng.make_output(req).outputs[0].finish_reason == "length"
    assert eng.stats()["preemptions"] == 0
    # the idle sequences lost their KV but not their tokens; they still generate correctly
    for i, s in enumerate(idle):
        assert s.token_ids[:31] == [1] + [10 + i] * 30 and len(s.token_ids) == 32
        r = eng.add_request(s, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        while not r.finished:
            eng.step()
        assert len(s.token_ids) == 35
        eng.close(s)
    assert eng.stats()["kv_blocks_used"] == 0
