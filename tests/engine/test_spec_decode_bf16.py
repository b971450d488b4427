"""Speculative decoding in bfloat16: a verify chunk's rows are attended with plain decode's arithmetic, so greedy
outputs stay token-identical with speculation on and off (not only in float32)."""

import random

import pytest
import torch

from support import make_tiny_model
from flowrt.engine import LLM, SamplingParams
from flowrt.engine.cpu import ops as cpu_ops

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
        "adaptive": False}  # every draft found: as many checked rows as possible

pytestmark = pytest.mark.skipif(not cpu_ops.supports(torch.bfloat16), reason="no bfloat16 CPU kernels here")


def _copying_prompts() -> list[list[int]]:
    """Prompts that repeat a span (drafts at every step), two of them sharing their first blocks (a cascade group)."""
    rnd = random.Random(0)
    shared = [1] + [rnd.randrange(3, 500) for _ in range(23)]
    prompts = []
    for i in range(6):
        span = [rnd.randrange(3, 500) for _ in range(12 + 3 * i)]
        head = shared if i < 2 else [1]
        prompts.append(head + span + span + span[:5])
    return prompts


@pytest.fixture
def kernels(request):
    """Whether the C++ kernels run (off: the plain-torch attention path)."""
    cpu_ops.set_enabled(request.param)
    yield request.param
    cpu_ops.set_enabled(True)


@pytest.mark.parametrize("arch,kernels", [  # qwen2 slow: its bf16 layers are checked fast in test_step_glue
    pytest.param("llama", True, id="llama"),
    pytest.param("qwen2", True, id="qwen2", marks=pytest.mark.slow),
    pytest.param("qwen3", True, id="qwen3"),
    pytest.param("llama", False, id="llama-torch-path"),
], indirect=["kernels"])
def test_bf16_greedy_identical_with_speculation(tmp_path, arch, kernels):
    model_dir = make_tiny_model(tmp_path / arch, arch=arch)
    prompts = [{"prompt_token_ids": p} for p in _copying_prompts()]
    params = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, n=2 if i == 2 else 1)
              for i in range(len(prompts))]
    outs = {}
    for name, spec in (("off", None), ("on", SPEC)):
        llm = LLM(model_dir, dtype="bfloat16", speculative_config=spec, block_size=8)
        outs[name] = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
        if spec is not None:
            st = llm.stats()
            assert st["spec_accepted_tokens"] > 50 and st["spec_draft_tokens"] > st["spec_accepted_tokens"]
    assert outs["on"] == outs["off"]
