"""The engine's triton attention backend (kernels run through Triton's interpreter on CPU) gives the same
greedy tokens as the torch backend, including prefix-cache hits and copy-on-write forks."""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from flowrt import kernels  # noqa: E402
from flowrt.engine import LLMEngine, SamplingParams  # noqa: E402
from flowrt.kernels import _dispatch  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # the engine on Triton's interpreter
    pytest.mark.skipif(not kernels.HAS_TRITON, reason=f"triton unavailable: {kernels.TRITON_IMPORT_ERROR}"),
    pytest.mark.skipif(not torch.cuda.is_available() and not _dispatch.can_interpret(),
                       reason="no CUDA, and triton was imported before TRITON_INTERPRET=1 was set"),
]


def run(eng, target, params):
    req = eng.add_request(target, params)
    while not req.finished:
        eng.step()
    return eng.make_output(req)


def scenario(backend, stories_path):
    eng = LLMEngine(model=stories_path, dtype="float32", attention_backend=backend, block_size=16)
    g = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prefix = eng.tokenize("Once upon a time there was a little dog named Max who liked to run in the park")
    out = [run(eng, {"prompt_token_ids": prefix + [300, 301]}, g).outputs[0].token_ids]
    out.append(run(eng, {"prompt_token_ids": prefix + [400]}, g).outputs[0].token_ids)  # prefix-cache hit
    seq = eng.open(prefix)
    out.append(run(eng, seq, g).outputs[0].token_ids)
    for child in eng.fork(seq, 2):  # copy-on-write of the shared partial block
        out.append(run(eng, child, g).outputs[0].token_ids)
        eng.close(child)
    eng.close(seq)
    s = eng.stats()
    assert s["kv_blocks_used"] == 0
    return out, s


def test_triton_backend_matches_torch(stories_path):
    got, s = scenario("triton", stories_path)
    ref, _ = scenario("torch", stories_path)
    assert got == ref
    assert s["prefix_cache_hit_tokens"] > 0 and s["cow_copies"] > 0
