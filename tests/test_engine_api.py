"""The offline API: sampling behaviour, stop conditions, logprobs, validation, leaks."""

import pydantic
import pytest
import torch

from flowrt.engine import LLM, SamplingParams
from flowrt.engine.sampler import filter_logits
from flowrt.engine.sequence import Request, Sequence


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


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=123, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], p)[0].outputs[0].token_ids
    mixed = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]],
                         [SamplingParams(max_tokens=9, temperature=0.7), p, SamplingParams(max_tokens=20, seed=5)])
    assert mixed[1].outputs[0].token_ids == alone
    other = llm.generate([PROMPTS[0]], p.clone(seed=124))[0].outputs[0].token_ids
    assert other != alone


def test_per_prompt_params(llm):
    outs = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=3, temperature=0), SamplingParams(max_tokens=7, temperature=0)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7]


def _req(**kw):
    seq = Sequence([1, 2, 3])
    seq.request = Request("r", SamplingParams(**kw), None, [1, 2, 3], [seq])
    return seq


def test_top_k_top_p_min_p_restrict_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    k = filter_logits(logits.clone(), [_req(top_k=2)])
    assert torch.isinf(k[0, 2:]).all() and torch.isfinite(k[0, :2]).all()
    p = filter_logits(logits.clone(), [_req(top_p=0.7)])
    assert torch.isfinite(p[0, :2]).all() and torch.isinf(p[0, 2:]).all()
    m = filter_logits(logits.clone(), [_req(min_p=0.5)])  # keeps p >= 0.25
    assert torch.isfinite(m[0, :2]).all() and torch.isinf(m[0, 2:]).all()


def test_sampled_tokens_stay_in_top_k(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(n=4, max_tokens=12, temperature=1.5, top_k=1, seed=1))[0]
    greedy = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].token_ids
    assert all(o.token_ids == greedy[: len(o.token_ids)] for o in out.outputs)


def test_penalties_change_logits_as_specified():
    from flowrt.engine.sampler import apply_penalties

    seq = _req(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    seq.token_ids = [0, 1, 1]  # prompt [0], outputs [1, 1]
    seq.prompt_len = 1
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    apply_penalties(logits, [seq])
    # repetition on prompt+output tokens {0, 1}: 2 -> 1, -2 -> -4; then output counts: token 1 twice
    assert torch.allclose(logits, torch.tensor([[1.0, -4.0 - 0.5 - 0.5, 1.0]]))


def test_repetition_penalty_reduces_repeats(llm):
    base = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=40, temperature=0))[0].outputs[0].token_ids
    pen = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.8))[0].outputs[0].token_ids
    assert len(set(pen)) / len(pen) > len(set(base)) / len(base)


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


def test_eos_stops_unless_ignored(llm):
    # force EOS (id 2) by min_tokens=0 and a long budget: the story model ends stories with EOS eventually
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=400, temperature=0))[0].outputs[0]
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == 2
    ign = llm.generate(["Once upon a time"], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0].outputs[0]
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


def test_prompt_larger_than_pool_is_rejected(stories_path):
    small = LLM(stories_path, dtype="float32", num_kv_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="more than the KV cache holds"):
        small.generate([{"prompt_token_ids": [1] * 100}])
    out = small.generate([{"prompt_token_ids": [1] * 30}], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 30  # fits alone: never fails for lack of blocks
    # a sequence that outgrows the whole pool ends with what it has, like one reaching max_model_len
    out = small.generate([{"prompt_token_ids": [1] * 40}], SamplingParams(max_tokens=60, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 64 - 40 + 1
    assert small.stats()["kv_blocks_used"] == 0


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
    from flowrt.engine.sampler import sample

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    seqs = [_req(temperature=1.0) for _ in range(4000)]
    g = torch.Generator().manual_seed(0)
    logits = torch.log(probs).expand(len(seqs), -1).clone()
    toks = torch.tensor(sample(logits, seqs, (), g).token_ids)
    freq = torch.bincount(toks, minlength=5).float() / len(seqs)
    assert freq[4] == 0  # zero-probability tokens are never drawn
    assert torch.allclose(freq, probs, atol=0.03), freq
