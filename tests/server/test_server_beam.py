"""/v1/completions with vLLM's use_beam_search: n beams per prompt, best first."""

import json
import time

import httpx
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
    # logprobs=0 too (issue 39 item 11): the beams' choices carry no log-probabilities, so it is refused like 2
    for extra, param in [({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs"), ({"logprobs": 0}, "logprobs"),
                         ({"n": 11}, "beam_width"), ({"temperature": 0.8}, "temperature")]:
        kw = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "extra_body": {"use_beam_search": True}, **extra}
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**kw)
        assert param in str(e.value)


@pytest.mark.parametrize("penalty", [float("nan"), float("inf"), -float("inf")])
def test_beam_search_refuses_a_length_penalty_that_is_not_finite(server, penalty):
    """Issue 39 item 11: NaN / inf made every beam's score NaN (HTTP 200)."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "n": 2, "use_beam_search": True, "length_penalty": penalty}
    r = httpx.post(server.url + "/v1/completions", content=json.dumps(body), timeout=60,   # NaN, Infinity: JSON5
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "length_penalty" in r.text, r.text


def _aborted(server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "flowrt_requests_aborted_total")


def test_a_beam_search_whose_client_left_is_aborted(server):
    """Issue 39 item 9: 8 prompts x 10 beams x 400 tokens, abandoned after a second, ran on to the end."""
    aborted = _aborted(server)
    body = {"model": MODEL, "prompt": [f"Once upon a time {i}" for i in range(8)], "n": 10, "max_tokens": 400,
            "use_beam_search": True, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    deadline, stats = time.monotonic() + 10, server.engine.stats()
    while (stats["num_running"] or stats["num_waiting"] or stats["kv_blocks_used"]) and time.monotonic() < deadline:
        time.sleep(0.02)
        stats = server.engine.stats()
    assert (stats["num_running"], stats["num_waiting"], stats["kv_blocks_used"]) == (0, 0, 0), stats
    assert _aborted(server) == aborted + 1
    r = httpx.post(server.url + "/v1/completions", json={**body, "prompt": "Hi", "max_tokens": 4, "n": 2}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2   # the engine serves on
