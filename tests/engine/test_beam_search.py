"""Beam search over copy-on-write forks: transformers' beams on the same weights, blocks shared, any pool size."""

import asyncio

import pytest
import torch

from support import _hf_model, make_tiny_model
from flowrt.engine import LLM, AsyncLLM, SamplingParams
from flowrt.engine.beam_search import BeamSearchParams

STORY_PROMPTS = [
    "Once upon a time",
    "The little dog ran to the park and saw a big red ball. He",
    "Lily",
    "One day, a girl named Sue went to the beach with her mom and dad. They played in the sand and",
    "Tom had a toy car",
]
TINY_PROMPTS = [[1, 5, 77, 300, 12, 9], [1, 400] + list(range(20, 60)), [1, 250]]
W, T = 4, 16


def hf_beams(model_dir: str, ids: list[int], width: int, n: int) -> list[list[int]]:
    """transformers' beam search, never ending early (min_new_tokens masks EOS): its beams' new tokens."""
    model = _hf_model(model_dir, None)
    out = model.generate(torch.tensor([ids]), num_beams=width, do_sample=False, length_penalty=1.0,
                         min_new_tokens=n, max_new_tokens=n, num_return_sequences=width, pad_token_id=0)
    return [s[len(ids):].tolist() for s in out]


def hf_logprob(model_dir: str, ids: list[int], new: list[int]) -> float:
    """Total float32 log-probability transformers gives `new` after `ids`."""
    model = _hf_model(model_dir, None)
    with torch.no_grad():
        lps = torch.log_softmax(model(input_ids=torch.tensor([ids + new])).logits[0].float(), dim=-1)
    return float(sum(lps[len(ids) - 1 + i, t] for i, t in enumerate(new)))


def check_parity(model_dir: str, prompts_ids: list[list[int]]) -> tuple[int, int]:
    """Best beams equal transformers', or tie with its best within 1e-5 (the only allowed difference).
    Returns (identical beams, beams)."""
    llm = LLM(model_dir, dtype="float32")
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts_ids],
                           BeamSearchParams(beam_width=W, max_tokens=T, ignore_eos=True))
    assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["open_sequences"] == 0
    same = 0
    for ids, out in zip(prompts_ids, outs):
        got = [s.output_tokens for s in out.sequences]
        assert len(got) == W and all(len(g) == T for g in got)
        assert [s.cum_logprob for s in out.sequences] == sorted((s.cum_logprob for s in out.sequences), reverse=True)
        ref = hf_beams(model_dir, ids, W, T)
        same += sum(g == r for g, r in zip(got, ref))
        if got[0] != ref[0]:
            assert abs(hf_logprob(model_dir, ids, got[0]) - hf_logprob(model_dir, ids, ref[0])) <= 1e-5, (ids, got, ref)
    return same, W * len(prompts_ids)


@pytest.mark.slow
def test_stories_beams_match_transformers(stories_path):
    tok = LLM(stories_path, dtype="float32").tokenizer
    same, total = check_parity(stories_path, [tok(p).input_ids for p in STORY_PROMPTS])
    assert same == total  # measured: 20 of 20 beams identical (best beams 5 of 5)


@pytest.mark.parametrize(
    "arch,tie", [("llama", True), ("llama", False), ("mistral", False), ("qwen2", True), ("qwen3", False)])
@pytest.mark.slow
def test_architectures_beams_match_transformers(tmp_path, arch, tie):
    model_dir = make_tiny_model(tmp_path / arch, arch=arch, tie=tie)
    same, total = check_parity(model_dir, TINY_PROMPTS)
    assert same == total  # measured: 12 of 12 beams identical for each architecture


def run_beams(model_dir, prompt, width, n, **engine_kw):
    llm = LLM(model_dir, dtype="float32", **engine_kw)
    out = llm.beam_search(prompt, BeamSearchParams(beam_width=width, max_tokens=n, ignore_eos=True))[0]
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["open_sequences"] == 0
    return [(s.tokens, s.cum_logprob) for s in out.sequences], stats


@pytest.mark.slow
def test_beams_share_blocks(stories_path):
    """The prompt is held once and beams share their common history: the peak stays within
    P/B + W * (T/B + 1) blocks, far below W separate copies."""
    bs, width, n = 4, 4, 24
    prompt = STORY_PROMPTS[3]
    beams, stats = run_beams(stories_path, prompt, width, n, block_size=bs)
    P = len(beams[0][0]) - n
    peak = stats["beam_peak_blocks"]
    assert P >= 20
    assert 0 < peak <= P / bs + width * (n / bs + 1)
    assert peak < width * (P + n) / bs / 2  # unshared beams would need twice as much at least
    assert stats["cow_copies"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("engine_kw", [{"num_kv_blocks": 10}, {"num_kv_blocks": 12, "max_num_batched_tokens": 4}])
def test_tiny_pool_gives_the_same_beams(stories_path, engine_kw):
    """A pool far smaller than the beams need: beams waiting for their round lose their KV to the others and
    recompute it (in other chunks and batches, so scores agree to float32 rounding, not bit for bit)."""
    ref, _ = run_beams(stories_path, STORY_PROMPTS[1], 4, T, block_size=4)
    got, stats = run_beams(stories_path, STORY_PROMPTS[1], 4, T, block_size=4, **engine_kw)
    assert stats["prefill_tokens_recomputed"] > 0
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in ref]
    assert [score for _, score in got] == pytest.approx([score for _, score in ref], abs=1e-4)


@pytest.mark.slow
def test_width_one_is_greedy(stories_path):
    llm = LLM(stories_path, dtype="float32")
    greedy = llm.generate(STORY_PROMPTS[0], SamplingParams(max_tokens=T, temperature=0, ignore_eos=True))[0]
    beam = llm.beam_search(STORY_PROMPTS[0], BeamSearchParams(beam_width=1, max_tokens=T, ignore_eos=True))[0]
    assert beam.sequences[0].output_tokens == greedy.outputs[0].token_ids
    assert beam.sequences[0].tokens[:len(greedy.prompt_token_ids)] == greedy.prompt_token_ids
    assert beam.sequences[0].output_text == greedy.outputs[0].text


@pytest.mark.slow
def test_eos_ends_a_beam_as_in_transformers(tmp_path):
    """Without ignore_eos, a continuation by EOS among the W best ends its beam ("stop", scored by its length
    with the EOS); the search runs on until no live beam can beat the finished ones: transformers' beams with
    early_stopping="never". The model's EOS row is made likely (0.9 x a frequent token's row)."""
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model(tmp_path / "eos", arch="llama", tie=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[2] = model.lm_head.weight[254] * 0.9
    model.save_pretrained(model_dir)
    ids, n = [1, 5, 77, 300, 12, 9], 12
    ref = _hf_model(model_dir, None).generate(
        torch.tensor([ids]), num_beams=4, do_sample=False, length_penalty=1.0, early_stopping="never",
        max_new_tokens=n, num_return_sequences=4, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    ref_tokens = []
    for seq in ref.sequences.tolist():
        new = seq[len(ids):]
        ref_tokens.append(new[:new.index(2) + 1] if 2 in new else new)
    llm = LLM(model_dir, dtype="float32")
    out = llm.beam_search({"prompt_token_ids": ids}, BeamSearchParams(beam_width=4, max_tokens=n))[0]
    assert [s.output_tokens for s in out.sequences] == ref_tokens
    assert [s.score for s in out.sequences] == pytest.approx(ref.sequences_scores.tolist(), abs=1e-5)
    stops = [s for s in out.sequences if s.finish_reason == "stop"]
    assert stops and all(s.tokens[-1] == 2 and len(s.output_tokens) < n for s in stops)
    assert llm.stats()["kv_blocks_used"] == 0


def test_bad_params_name_the_field():
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(temperature=0.7)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=11)
    for bad in (float("nan"), float("inf"), -float("inf")):   # issue 39 item 11: every score would be NaN
        with pytest.raises(ValueError, match="length_penalty"):
            BeamSearchParams(length_penalty=bad)


def test_async_beam_search_and_kept_beams(stories_path):
    ref, _ = run_beams(stories_path, STORY_PROMPTS[0], 3, 8)

    async def main():
        async with AsyncLLM(stories_path, dtype="float32") as engine:
            params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
            out = await engine.beam_search(STORY_PROMPTS[0], params)
            assert [(s.tokens, s.cum_logprob) for s in out.sequences] == ref
            # continuing a sequence: the beams are its forks, kept open; the sequence itself is unchanged
            seq = engine.open(out.sequences[0].tokens[:len(out.sequences[0].tokens) - 8])
            kept = await engine.beam_search(seq, params, keep=True)
            assert [s.tokens for s in kept.sequences] == [t for t, _ in ref]
            assert len(seq) == len(ref[0][0]) - 8
            beam = kept.sequences[0].sequence
            assert beam.token_ids == ref[0][0]
            nxt = await engine.generate(beam, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
            assert len(nxt.outputs[0].token_ids) == 4
            for s in kept.sequences:
                s.sequence.close()
            seq.close()
            st = engine.stats()
            assert st["open_sequences"] == 0 and st["kv_blocks_used"] == 0

    asyncio.run(main())


@pytest.mark.slow
def test_json_beams_are_valid_json(stories_path):
    """Each beam carries its own grammar state (forked with it): every beam is valid JSON of the schema."""
    import json

    from flowrt.engine import StructuredOutputsParams

    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 8},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
    llm = LLM(stories_path, dtype="float32")
    params = BeamSearchParams(beam_width=4, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    out = llm.beam_search("Lily is a girl. JSON:", params)[0]
    assert len(out.sequences) == 4 and len({tuple(s.tokens) for s in out.sequences}) == 4
    for s in out.sequences:
        assert s.finish_reason == "stop"
        value = json.loads(s.output_text)
        assert set(value) == {"name", "age"} and 0 <= value["age"] <= 120
    assert llm.stats()["kv_blocks_used"] == 0
