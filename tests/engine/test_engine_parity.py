"""Greedy output equals transformers token for token, whatever the batching, chunking or preemption."""

import pytest

from support import STORIES_GREEDY_30, STORIES_PROMPT_IDS, hf_greedy, make_tiny_model
from flowrt.engine import LLM, SamplingParams

PROMPTS = [
    "Once upon a time",
    "The little dog ran to the park and saw a big red ball. He",
    "Lily",
    "One day, a girl named Sue went to the beach with her mom and dad. They played in the sand and",
    "Tom had a toy car",
]


def run_flowrt(model_dir, prompts_ids, max_tokens, **kw):
    llm = LLM(model_dir, dtype="float32", **kw)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts_ids], params)
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0, "blocks leaked"
    return [o.outputs[0].token_ids for o in outs], stats


def test_stories_documented_output(stories_path):
    llm = LLM(stories_path, dtype="float32")
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=30, temperature=0))[0]
    assert out.prompt_token_ids == STORIES_PROMPT_IDS
    assert out.outputs[0].token_ids[:5] == [432, 383, 286, 261, 376]
    assert out.outputs[0].text == STORIES_GREEDY_30
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "engine_kw",
    [
        {},
        {"max_num_batched_tokens": 7},  # chunked prefill, decodes and prefill chunks mixed in steps
        {"num_kv_blocks": 9, "block_size": 8},  # too small for all at once: preemption
        {"max_num_seqs": 2, "block_size": 4},
    ],
    ids=["batched", "chunked", "preempt", "few-seqs"],
)
@pytest.mark.slow
def test_stories_batch_matches_transformers(stories_path, engine_kw):
    llm_tok = LLM(stories_path, dtype="float32").tokenizer
    ids = [llm_tok(p).input_ids for p in PROMPTS]
    ref = [hf_greedy(stories_path, p, 24) for p in ids]
    got, stats = run_flowrt(stories_path, ids, 24, **engine_kw)
    assert got == ref
    if "num_kv_blocks" in engine_kw:
        assert stats["preemptions"] > 0


@pytest.mark.parametrize(
    "arch,tie",
    [("llama", True), ("llama", False), ("mistral", False), ("qwen2", True), ("qwen3", False)],
)
@pytest.mark.slow
def test_architectures_match_transformers(tmp_path, arch, tie):
    model_dir = make_tiny_model(tmp_path / arch, arch=arch, tie=tie)
    ids = [[1, 5, 77, 300, 12, 9], [1, 400] + list(range(20, 60)), [1, 250]]
    ref = [hf_greedy(model_dir, p, 12) for p in ids]
    got, _ = run_flowrt(model_dir, ids, 12, max_num_batched_tokens=16, block_size=8)
    assert got == ref


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    model_dir = make_tiny_model(tmp_path / "l3", arch="llama", rope_parameters=rope)
    ids = [[1] + list(range(30, 110)), [1, 7, 8]]
    ref = [hf_greedy(model_dir, p, 10) for p in ids]
    got, _ = run_flowrt(model_dir, ids, 10)
    assert got == ref
