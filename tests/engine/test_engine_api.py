"""The offline API: sampling behaviour, stop conditions, logprobs, validation, leaks."""

import pydantic
import pytest
import torch

from flowrt.engine import LLM, SamplingParams
from flowrt.engine.decoding.sampler import filter_logits
from flowrt.engine.request.sequence import Request, SampleState, Sequence


@pytest.fixture(scope="module")
def llm(stories_path):
    return LLM(stories_path, dtype="float32")


PROMPTS = ["Once upon a time", "The cat sat on", "Lily and Tom went to the park. They"]


def test_prompt_forms_and_outputs(llm):
    ids = llm.tokenizer("Once upon a time").input_ids
    outs = llm.generate(["Once upon a time", {"prompt_token_ids": ids}, {"prompt": "Once upon a time"}],
                        SamplingParams(max_tokens=5, temperature=0))
    assert len(outs) == 3
    assert all(o.prompt_token_ids == ids for o in outs)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert outs[0].outputs[0].text == llm.tokenizer.decode(ids + outs[0].outputs[0].token_ids,
                                                           skip_special_tokens=True)[len("Once upon a time"):]
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=123, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], p)[0].outputs[0].token_ids
    mixed = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]],
                         [SamplingParams(max_tokens=9, temperature=0.7), p, SamplingParams(max_tokens=20, seed=5)])
    assert mixed[1].outputs[0].token_ids == alone
    other = llm.generate([PROMPTS[0]], p.model_copy(update={"seed": 124}))[0].outputs[0].token_ids
    assert other != alone


def test_per_prompt_params(llm):
    outs = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=3, temperature=0),
                                      SamplingParams(max_tokens=7, temperature=0)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7]


def _req(**kw):
    seq = Sequence([1, 2, 3])
    seq.sample = SampleState(Request("r", SamplingParams(**kw), None, [1, 2, 3], [seq]))
    return seq


def test_top_k_top_p_min_p_restrict_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    k = filter_logits(logits.clone(), [_req(top_k=2)])
    assert torch.isinf(k[0, 2:]).all() and torch.isfinite(k[0, :2]).all()
    p = filter_logits(logits.clone(), [_req(top_p=0.7)])
    assert torch.isfinite(p[0, :2]).all() and torch.isinf(p[0, 2:]).all()
    m = filter_logits(logits.clone(), [_req(min_p=0.5)])  # keeps p >= 0.25
    assert torch.isfinite(m[0, :2]).all() and torch.isinf(m[0, 2:]).all()


def test_top_p_keeps_the_same_tokens_as_a_full_sort():
    """Top-p looks among each row's largest logits first; rows whose nucleus is bigger (flat rows, top_p near 1) fall
    back to a full sort. Both keep exactly the tokens the full-sort definition keeps, with their logits."""
    from flowrt.engine.decoding import sampler

    torch.manual_seed(0)
    V = 3 * sampler.TOP_P_CANDIDATES
    rows = [torch.randn(V) * s for s in (0.2, 1.0, 4.0, 12.0)]
    logits = torch.stack(rows + rows)
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.3, 0.999, 0.05, 0.6, 1e-3])

    srt, idx = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(srt, dim=-1)
    drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
    drop[:, 0] = False
    want = logits.clone().scatter_(1, idx, srt.masked_fill(drop, float("-inf")))

    got = sampler._top_p(logits.clone(), top_p)
    kept = torch.isfinite(want)
    assert (kept.sum(1) > sampler.TOP_P_CANDIDATES).any() and (kept.sum(1) < sampler.TOP_P_CANDIDATES).any()
    assert torch.equal(torch.isfinite(got), kept)
    assert torch.equal(got[kept], logits[kept])


def test_greedy_tokens_are_argmax():
    """The chunked greedy pick returns torch.argmax's indices: ties (the first maximum, within a chunk and across
    chunks), a maximum in the last entry, NaN, rows all -inf, vocabularies no chunk size divides, bf16."""
    from flowrt.engine.decoding.sampler import greedy_tokens

    torch.manual_seed(0)
    for V in (49152, 512, 320, 1000):
        x = torch.randn(7, V)
        x[1, 3] = x[1, 200 % V] = 50.0  # a tie: the first wins
        x[2, 5] = x[2, 6] = 50.0  # a tie inside one chunk
        x[3, -1] = 50.0
        x[4, V // 2] = float("nan")
        x[5] = float("-inf")
        for t in (x, x.bfloat16()):
            assert torch.equal(greedy_tokens(t), t.argmax(dim=-1))


def test_sampled_tokens_stay_in_top_k(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(n=4, max_tokens=12, temperature=1.5, top_k=1, seed=1))[0]
    greedy = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].token_ids
    assert all(o.token_ids == greedy[: len(o.token_ids)] for o in out.outputs)


def test_penalties_change_logits_as_specified():
    from flowrt.engine.decoding.sampler import apply_penalties

    seq = _req(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    seq.token_ids = [0, 1, 1]  # prompt [0], outputs [1, 1]
    seq.sample.prompt_len = 1
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    apply_penalties(logits, [seq])
    # repetition on prompt+output tokens {0, 1}: 2 -> 1, -2 -> -4; then output counts: token 1 twice
    assert torch.allclose(logits, torch.tensor([[1.0, -4.0 - 0.5 - 0.5, 1.0]]))


@pytest.mark.slow
def test_repetition_penalty_reduces_repeats(llm):
    base = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=40, temperature=0))[0].outputs[0].token_ids
    pen_params = SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.8)
    pen = llm.generate([PROMPTS[0]], pen_params)[0].outputs[0].token_ids
    assert len(set(pen)) / len(pen) > len(set(base)) / len(base)


@pytest.mark.slow
def test_stop_strings_and_ids(llm):
    greedy = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=30, temperature=0))[0].outputs[0]
    assert "Lily" in greedy.text
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=30, temperature=0, stop=["Lily"]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "Lily"
    assert out.text == greedy.text[: greedy.text.index("Lily")]
    inc = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=30, temperature=0, stop="Lily",
                                                   include_stop_str_in_output=True))[0].outputs[0]
    assert inc.text.endswith("Lily")
    tok = greedy.token_ids[3]
    ids = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[tok]))[0].outputs[0]
    assert ids.finish_reason == "stop" and ids.stop_reason == tok and ids.token_ids == greedy.token_ids[:4]
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.slow
def test_eos_stops_unless_ignored(llm):
    # force EOS (id 2) by min_tokens=0 and a long budget: the story model ends stories with EOS eventually
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=400, temperature=0))[0].outputs[0]
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == 2
    ign = llm.generate(["Once upon a time"],
                       SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0].outputs[0]
    assert ign.finish_reason == "length" and len(ign.token_ids) == 50
    mn = llm.generate(["Once upon a time"], SamplingParams(max_tokens=20, min_tokens=20, temperature=0,
                                                         stop_token_ids=[ign.token_ids[0]]))[0].outputs[0]
    assert len(mn.token_ids) == 20


def test_logprobs(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and lp[tok].rank == 1  # greedy picks the top token
        assert len(lp) == 3
        assert all(v.logprob <= 0 for v in lp.values())
    assert out.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)))


@pytest.mark.parametrize(
    "kw,field",
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"), ({"n": 0}, "n"),
     ({"max_tokens": -1}, "max_tokens"), ({"min_p": 2}, "min_p"), ({"stop": [""]}, "stop"),
     ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"bogus": 1}, "bogus"), ({"logprobs": 100}, "logprobs")],
)
def test_invalid_params_name_the_field(kw, field):
    with pytest.raises(pydantic.ValidationError) as e:
        SamplingParams(**kw)
    assert field in str(e.value)


def test_bad_prompts_are_rejected_before_any_work(llm):
    before = llm.stats()["steps"]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        llm.generate(["ok", ""], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="prompt 0 has 600 tokens, more than max_model_len=512"):
        llm.generate([{"prompt_token_ids": [1] * 600}])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [1, 99999]}])
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()])
    assert llm.stats()["steps"] == before and llm.stats()["num_waiting"] == 0
    assert llm.generate(["Once"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # still usable


@pytest.mark.slow
def test_prompt_larger_than_pool_is_rejected(stories_path):
    small = LLM(stories_path, dtype="float32", num_kv_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="more than the KV cache holds"):
        small.generate([{"prompt_token_ids": [1] * 100}])
    out = small.generate([{"prompt_token_ids": [1] * 30}], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 30  # fits alone: never fails for lack of blocks
    # prompt + max_tokens beyond the whole pool is refused at submission (not silently cut short)
    steps = small.stats()["steps"]
    with pytest.raises(ValueError, match=r"prompt 1 has 40 tokens and max_tokens=60: up to 99 tokens of KV, "
                                         r"more than the KV cache holds \(4 blocks of 16 = 64 tokens\)"):
        small.generate(["ok", {"prompt_token_ids": [1] * 40}], SamplingParams(max_tokens=60, ignore_eos=True))
    assert small.stats()["num_waiting"] == 0 and small.stats()["steps"] == steps
    # exactly the pool: 40 + 25 tokens hold 64 in the KV cache (the last sampled token is never fed back)
    out = small.generate([{"prompt_token_ids": [1] * 40}], SamplingParams(max_tokens=25, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 25
    assert small.stats()["kv_blocks_used"] == 0


def test_max_model_len_caps_the_pool_check(stories_path):
    small = LLM(stories_path, dtype="float32", num_kv_blocks=4, block_size=16, max_model_len=60)
    # ends at max_model_len (60 tokens) long before max_tokens: fits, so it is not refused
    out = small.generate([{"prompt_token_ids": [1] * 40}], SamplingParams(max_tokens=1000, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 20


def test_model_errors(tmp_path, stories_path):
    with pytest.raises(FileNotFoundError):
        LLM(str(tmp_path / "nope"))
    import json
    import shutil

    bad = tmp_path / "gpt2ish"
    shutil.copytree(stories_path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((ValueError, KeyError), match="(?i)gpt2|unsupported|unrecognized"):
        LLM(str(bad))
    with pytest.raises(pydantic.ValidationError, match="dtype"):
        LLM(stories_path, dtype="int8")


def test_random_sampling_follows_the_distribution():
    from flowrt.engine.decoding.sampler import sample

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    seqs = [_req(temperature=1.0) for _ in range(4000)]
    g = torch.Generator().manual_seed(0)
    logits = torch.log(probs).expand(len(seqs), -1).clone()
    toks = torch.tensor(sample(logits, seqs, (), g).token_ids)
    freq = torch.bincount(toks, minlength=5).float() / len(seqs)
    assert freq[4] == 0  # zero-probability tokens are never drawn
    assert torch.allclose(freq, probs, atol=0.03), freq


# ---- issue 11: concurrent generate, submission-time validation ----------------------------------------

@pytest.mark.slow
def test_generate_from_several_threads_is_serialized(llm):
    import threading

    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    jobs = [PROMPTS[i % 3:] + PROMPTS[: i % 3] for i in range(4)]
    want = [[o.outputs[0].token_ids for o in llm.generate(j, p)] for j in jobs]
    got, errors = [None] * len(jobs), []
    start = threading.Barrier(len(jobs))

    def work(i):
        try:
            start.wait()
            got[i] = [o.outputs[0].token_ids for o in llm.generate(jobs[i], p)]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert got == want
    assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["num_running"] == 0


def test_sequence_of_another_engine_is_refused(llm, stories_path):
    from flowrt.engine.llm_engine import LLMEngine

    other = LLMEngine(model=stories_path, dtype="float32")
    seq = other.open(llm.tokenizer("Once upon a time").input_ids)
    with pytest.raises(ValueError, match="another engine"):
        llm.engine.add_request(seq, SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(ValueError, match="another engine"):
        llm.engine.fork(seq)
    assert llm.stats()["num_waiting"] == 0 and llm.stats()["kv_blocks_used"] == 0


@pytest.mark.slow
def test_min_tokens_holds_off_stop_strings_ids_and_eos(llm):
    greedy = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].outputs[0]
    stopped = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=30, temperature=0, stop="Lily"))[0].outputs[0]
    k = len(stopped.token_ids)  # the stop string ends within token k
    held = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=30, min_tokens=k + 2, temperature=0,
                                                    stop="Lily", ignore_eos=True))[0].outputs[0]
    assert len(held.token_ids) >= k + 2
    assert held.token_ids == greedy.token_ids[: len(held.token_ids)]
    tok = greedy.token_ids[1]
    ids = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=30, min_tokens=5, temperature=0,
                                                   stop_token_ids=[tok]))[0].outputs[0]
    assert len(ids.token_ids) >= 5 and tok not in ids.token_ids[:5]


def test_stop_token_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["Once"], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[10**6]))
    assert llm.stats()["num_waiting"] == 0


def test_numpy_prompts_are_accepted(llm):
    import numpy as np

    ids = llm.tokenizer(PROMPTS[0]).input_ids
    p = SamplingParams(max_tokens=4, temperature=0)
    want = llm.generate({"prompt_token_ids": ids}, p)[0].outputs[0].token_ids
    for prompt in (np.array(ids, dtype=np.int64), np.array(ids, dtype=np.int32), [np.int64(t) for t in ids],
                   {"prompt_token_ids": np.array(ids)}, [np.array(ids)]):
        out = llm.generate(prompt, p)
        assert len(out) == 1 and out[0].outputs[0].token_ids == want and out[0].prompt_token_ids == ids
        assert all(type(t) is int for t in out[0].prompt_token_ids)
    with pytest.raises(ValueError, match="1-D integer array"):
        llm.generate({"prompt_token_ids": np.array(ids, dtype=np.float32)}, p)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": np.array([1, 10**6])}, p)


@pytest.mark.parametrize("seed", [-1, 2**63, 2**64])
def test_seed_out_of_range_names_seed(seed):
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)
    SamplingParams(seed=2**63 - 1)


def test_largest_seed_samples(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(n=2, max_tokens=3, seed=2**63 - 1))[0]
    assert [len(o.token_ids) for o in out.outputs] == [3, 3]


def test_empty_prompts_are_refused(llm):
    for prompt in ("", [], {"prompt_token_ids": []}, {"prompt": ""}):
        with pytest.raises(ValueError, match="prompt 0 is empty"):
            llm.generate([prompt], SamplingParams(max_tokens=2))
    import numpy as np

    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": np.array([], dtype=np.int64)}, SamplingParams(max_tokens=2))
    assert llm.stats()["num_waiting"] == 0


def test_llm_leaves_one_openmp_team_whatever_thread_calls_it(stories_path, monkeypatch):
    """The building thread's team ends after construction and each call's when it returns (engine/cpu/threads.py
    release_openmp_team: a team left on another thread makes the caller's workers sleep between regions)."""
    import threading

    from flowrt.engine import llm as llm_module

    calls: list[int] = []
    monkeypatch.setattr(llm_module, "release_openmp_team", lambda: calls.append(threading.get_ident()) or True)
    llm = LLM(stories_path, dtype="float32")
    main = threading.get_ident()
    assert calls == [main]
    p = SamplingParams(max_tokens=2, temperature=0)
    llm.generate("Once upon a time", p)
    assert calls == [main, main]
    t = threading.Thread(target=lambda: llm.generate("Once upon a time", p))
    t.start()
    t.join()
    assert calls == [main, main, t.ident]
