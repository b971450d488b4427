"""/v1/completions with vLLM's use_beam_search: n beams per prompt, best first."""

import openai
import pytest

from support import STORIES, serve_model
from flowrt.engine import LLM, BeamSearchParams

MODEL = "stories"


@pytest.fixture(scope="module")
def server():
    yield from serve_model(STORIES, served_model_name=MODEL)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_beam_search_choices_are_the_engines_beams(client):
    r = client.completions.create(model=MODEL, prompt=["Once upon a time", "Tom had a toy car"], n=3, max_tokens=10,
                                  extra_body={"use_beam_search": True, "ignore_eos": True})
    llm = LLM(str(STORIES), dtype="float32")
    ref = llm.beam_search(["Once upon a time", "Tom had a toy car"],
                          BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True))
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [s.output_text for o in ref for s in o.sequences]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 60


def test_beam_search_refuses_what_it_cannot_do(client):
    for extra, param in [({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs"), ({"n": 11}, "beam_width"),
                         ({"temperature": 0.8}, "temperature")]:
        kw = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "extra_body": {"use_beam_search": True}, **extra}
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**kw)
        assert param in str(e.value)
