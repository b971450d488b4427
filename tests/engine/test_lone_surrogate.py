"""A prompt that is not valid Unicode (a lone surrogate) is a ValueError naming the problem, from
LLM.generate and the tokenizer, never tokenizers' bare "TypeError: TextInputSequence must be str"
(issue 27, item 3)."""

import pytest
from support import STORIES


@pytest.fixture(scope="module")
def llm():
    from flowrt.engine import LLM

    return LLM(model=str(STORIES), dtype="float32", seed=0)


def test_llm_generate_refuses_a_lone_surrogate(llm):
    from flowrt.engine import SamplingParams

    with pytest.raises(ValueError, match=r"prompt 0 contains a lone surrogate '\\ud800' at character 3"):
        llm.generate("hi \ud800", SamplingParams(max_tokens=2))
    out = llm.generate("hi \U0001F600", SamplingParams(max_tokens=2))  # a whole pair is fine
    assert len(out[0].outputs[0].token_ids) == 2


def test_tokenizer_names_the_problem():
    from flowrt.engine.model.tokenizer import load_tokenizer

    tok = load_tokenizer(STORIES)
    with pytest.raises(ValueError, match="lone surrogate"):
        tok.encode("a \udc00")
    with pytest.raises(ValueError, match=r"text\[1\] contains a lone surrogate"):
        tok(["ok", "a \udc00"])
