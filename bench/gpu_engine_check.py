#!/usr/bin/env python
"""On a CUDA machine: the engine end to end on the GPU with the triton backend.

1. Greedy tokens on stories260K with attention_backend="triton" equal the torch backend (also on the GPU),
   with a prefix-cache hit and a copy-on-write fork in the run.
2. Throughput of the main workload shape (32 requests, prompts 32-256, 16-128 new tokens) on a random-weight
   SmolLM2-135M-shaped Llama (vocab cut to stories260K's tokenizer) built on the spot, bf16.

    python bench/gpu_engine_check.py
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORIES = os.path.join(ROOT, "tests", "models", "stories260K")


def run(eng, target, params):
    req = eng.add_request(target, params)
    while not req.finished:
        eng.step()
    return eng.make_output(req)


def parity() -> None:
    from flowrt.engine import LLMEngine, SamplingParams

    res = {}
    for backend in ("triton", "torch"):
        eng = LLMEngine(model=STORIES, dtype="float32", attention_backend=backend, device="cuda")
        g = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        prefix = eng.tokenize("Once upon a time there was a little dog named Max who liked to run in the park")
        outs = [run(eng, {"prompt_token_ids": prefix + [300 + i]}, g).outputs[0].token_ids for i in range(3)]
        seq = eng.open(prefix)
        outs.append(run(eng, seq, g).outputs[0].token_ids)
        for c in eng.fork(seq, 2):
            outs.append(run(eng, c, g).outputs[0].token_ids)
        res[backend] = (outs, eng.stats())
    same = res["triton"][0] == res["torch"][0]
    s = res["triton"][1]
    print(f"engine parity triton vs torch on cuda: {'OK' if same else 'MISMATCH'} "
          f"(prefix hits {s['prefix_cache_hit_tokens']} tokens, cow copies {s['cow_copies']})")


def throughput() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from common import main_workload
    from flowrt.engine import LLM, SamplingParams

    d = tempfile.mkdtemp()
    cfg = LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      tie_word_embeddings=True, rope_theta=100000.0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(STORIES, f), d)
    reqs = main_workload(vocab=512)
    gen = sum(r["max_new"] for r in reqs)
    prompts = [{"prompt_token_ids": r["prompt"]} for r in reqs]
    for backend in ("triton", "torch"):
        t0 = time.perf_counter()
        llm = LLM(d, dtype="bfloat16", attention_backend=backend, device="cuda")
        params = [SamplingParams(max_tokens=r["max_new"], temperature=0, ignore_eos=True) for r in reqs]
        llm.generate(prompts[:4], params[:4])
        start = time.perf_counter() - t0
        times = []
        for _ in range(3):
            llm.reset_prefix_cache()
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.generate(prompts, params)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        w = statistics.median(times)
        print(f"main workload on GPU, {backend:6s}: {w:.2f} s, {gen / w:.0f} generated tok/s "
              f"(start {start:.1f} s, {llm.stats()['steps']} steps total)")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        sys.exit(2)
    for fn in (parity, throughput):
        try:
            fn()
        except Exception:
            import traceback

            traceback.print_exc()
