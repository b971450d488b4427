"""`flowrt serve` over stories260K, driven by the official openai client (and httpx for raw checks).

One server for the whole module: a real AsyncLLM on the tiny model behind uvicorn on a free loopback port.
"""

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support import STORIES, STORIES_GREEDY_30, serve_model

MODEL = "stories260K"
KEY = "test-key"
MAX_BODY = 64 * 1024
# SOURCE.md: greedy continuation of "Once upon a time" (30 tokens) from Hugging Face transformers.
PROMPT = "Once upon a time"
PROMPT_IDS = [1, 403, 407, 261, 378]
GREEDY_30 = STORIES_GREEDY_30


@pytest.fixture(scope="module")
def server():
    yield from serve_model(STORIES, served_model_name=MODEL, model_path=str(STORIES), api_key=KEY,
                           max_body_bytes=MAX_BODY)


@pytest.fixture(scope="module")
def tiny_pool_server():
    """A KV pool of 4 blocks of 16 tokens: a request needing more than 64 tokens can never run."""
    yield from serve_model(STORIES, engine_kwargs={"num_kv_blocks": 4, "block_size": 16}, served_model_name=MODEL)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _auth():
    return {"Authorization": f"Bearer {KEY}"}


def _wait_idle(engine, timeout=10.0):
    """Waits until the engine runs nothing; returns its stats."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_blocks_used"] == 0:
            return s
        if time.monotonic() > deadline:
            return s
        time.sleep(0.02)


def _sse_events(lines):
    """The `data:` payloads of an SSE stream (strings), in order."""
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


# ---- models, health -----------------------------------------------------------------------------------------


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


# ---- completions --------------------------------------------------------------------------------------------


def test_completion_greedy_matches_transformers(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL
    (c,) = r.choices
    assert c.text == GREEDY_30
    assert c.finish_reason == "length" and c.index == 0
    assert r.usage.prompt_tokens == len(PROMPT_IDS) and r.usage.completion_tokens == 30
    assert r.usage.total_tokens == 35
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # 5 tokens fill no 16-token block: nothing to reuse


def test_completion_token_id_prompt_and_batch(server, client):
    r = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=30, temperature=0)
    assert r.choices[0].text == GREEDY_30
    r = client.completions.create(model=MODEL, prompt=[PROMPT, "Tom"], max_tokens=30, temperature=0, n=2,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text == GREEDY_30
    assert r.choices[2].text == r.choices[3].text != GREEDY_30
    tom = server.engine.tokenizer.encode("Tom")
    assert r.usage.prompt_tokens == len(PROMPT_IDS) + len(tom)
    assert r.usage.completion_tokens == 4 * 30


def test_cached_tokens_reported(server, client):
    long_prompt = PROMPT + " there was a little girl named Lily. She loved to play outside in the park." * 3
    client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2, temperature=0)
    r = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2, temperature=0)
    # every full block of the prompt was computed by the first request
    assert r.usage.prompt_tokens_details.cached_tokens >= 16
    assert r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens


def test_stream_completion_matches_and_reports_usage(server, client):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == GREEDY_30
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert chunks[-1].usage.prompt_tokens == len(PROMPT_IDS)
    assert all(c.usage is None for c in chunks[:-1])
    # raw wire format: SSE data lines, ending with [DONE]
    with httpx.stream("POST", server.url + "/v1/completions", headers=_auth(), timeout=30,
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "text_completion" for e in events[:-1])


def test_n2_forks_prompt_once(server, client):
    """n=2 computes the prompt once: both samples share its KV blocks copy-on-write."""
    def computed(prompt, n):
        _wait_idle(server.engine)
        before = server.engine.stats()["prefill_tokens_computed"]
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=7, n=n,
                                      extra_body={"ignore_eos": True})
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        return server.engine.stats()["prefill_tokens_computed"] - before, r

    # two fresh prompts of the same length that share no prefix block (different first words)
    c1, r1 = computed("Tom liked to play outside in the park with his big red ball and his dog.", 1)
    c2, r2 = computed("Ben liked to play outside in the park with his big red ball and his dog.", 2)
    assert r1.usage.prompt_tokens == r2.usage.prompt_tokens == 29
    assert [c.index for c in r2.choices] == [0, 1] and r2.usage.completion_tokens == 24
    # the second sample adds its own decode steps (< max_tokens), not a second prefill of the prompt
    assert c2 - c1 < 12
    prompt = PROMPT + " there was a little girl named Lily. She loved to play outside in the park."
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=7, n=2,
                                  extra_body={"ignore_eos": True})
    # streamed n=2: interleaved by index, each choice finishes once
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=7, n=2,
                                            stream=True, extra_body={"ignore_eos": True}))
    texts = {0: "", 1: ""}
    finishes = []
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes.append(c.index)
    assert sorted(finishes) == [0, 1]
    assert texts == {0: r.choices[0].text, 1: r.choices[1].text}


def test_stop_strings(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=[" Lily"])
    c = r.choices[0]
    assert c.text == ", there was a little girl named"
    assert c.finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0,
                                            stop=" Lily", stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=" Lily",
                                  extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == ", there was a little girl named Lily"


def test_seed_reproducible(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    assert a == b
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert len(others | {a}) > 1


def test_completion_logprobs_and_echo(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for _tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(value, abs=1e-4)  # greedy: the chosen token is the best one
    assert lp.text_offset == sorted(lp.text_offset)

    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, echo=True)
    c = r.choices[0]
    assert c.text.startswith(PROMPT) and len(c.text) > len(PROMPT)
    assert len(c.logprobs.tokens) == len(PROMPT_IDS) + 4
    assert c.logprobs.token_logprobs[0] is None  # the first prompt token has no logprob
    assert all(v <= 0 for v in c.logprobs.token_logprobs[1:])

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                            stream=True))
    streamed = [t for ch in chunks for t in (ch.choices[0].logprobs.tokens if ch.choices[0].logprobs else [])]
    assert streamed == lp.tokens


# ---- errors -------------------------------------------------------------------------------------------------


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_error_statuses(server, client):
    url = server.url + "/v1/completions"
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    # 400: invalid parameters, named
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"top_k": -7})
    assert e.value.body["param"] == "top_k"
    err = _error(httpx.post(url, headers=_auth(), json={**body, "n": 0}), 400)
    assert err["param"] == "n"
    err = _error(httpx.post(url, headers={**_auth(), "content-type": "application/json"}, content=b"{not json"), 400)
    assert err["type"] == "invalid_request_error"
    _error(httpx.post(url, headers=_auth(), json={"model": MODEL}), 400)  # no prompt
    # 400: over the context length (512)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT_IDS * 110, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=600)
    # 401: missing or wrong key
    err = _error(httpx.post(url, json=body), 401)
    assert err["code"] == "invalid_api_key"
    _error(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    # 404: unknown model
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt=PROMPT)
    assert e.value.code == "model_not_found"
    # 413: body over the limit
    err = _error(httpx.post(url, headers=_auth(), json={**body, "prompt": "x" * (MAX_BODY + 10)}), 413)
    assert err["code"] == "request_too_large"
    # 400 when the model has no chat template
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])


def test_bad_requests_do_not_disturb_others(server, client):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        good = asyncio.create_task(aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30,
                                                              temperature=0))
        bad = [aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=9),
               aclient.completions.create(model=MODEL, prompt=[[]], max_tokens=2),
               aclient.completions.create(model=MODEL, prompt=[10**6], max_tokens=2),
               aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"min_p": 7})]
        results = await asyncio.gather(*bad, return_exceptions=True)
        out = await good
        await aclient.close()
        return results, out

    results, out = asyncio.run(main())
    assert all(isinstance(r, openai.BadRequestError) for r in results), results
    assert out.choices[0].text == GREEDY_30


# ---- concurrency, disconnects ---------------------------------------------------------------------------------


def test_64_concurrent_streams(server):
    async def one(aclient, i):
        want = 4 + i % 13
        text, finish, usage = "", None, None
        stream = await aclient.completions.create(
            model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=want, temperature=0.8, seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for ch in stream:
            for c in ch.choices:
                text += c.text
                finish = c.finish_reason or finish
            usage = ch.usage or usage
        assert text
        return want, usage.completion_tokens, finish

    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        res = await asyncio.gather(*(one(aclient, i) for i in range(64)))
        await aclient.close()
        return res

    res = asyncio.run(main())
    assert len(res) == 64
    assert all(want == got and finish == "length" for want, got, finish in res), res
    s = _wait_idle(server.engine)
    assert s["kv_blocks_used"] == 0 and s["num_running"] == 0


def _metric_value(server, name, **labels):
    text = httpx.get(server.url + "/metrics").text
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    _wait_idle(server.engine)
    aborted_before = _metric_value(server, "flowrt_requests_aborted_total")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=_auth(), timeout=30) as r:
        events = (line for line in r.iter_lines() if line)
        for _ in range(3):
            assert next(events).startswith("data: ")
        assert server.engine.stats()["kv_blocks_used"] > 0
    # the client closed the connection: the request is aborted and its blocks released
    s = _wait_idle(server.engine)
    assert s["num_running"] == 0 and s["kv_blocks_used"] == 0
    deadline = time.monotonic() + 5
    while _metric_value(server, "flowrt_requests_aborted_total") <= aborted_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric_value(server, "flowrt_requests_aborted_total") == aborted_before + 1
    assert _metric_value(server, "flowrt_http_requests_total", status="499") >= 1


def test_disconnect_non_streaming_aborts(server):
    _wait_idle(server.engine)
    aborted_before = _metric_value(server, "flowrt_requests_aborted_total")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "temperature": 0, "ignore_eos": True, "n": 4}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=_auth(), timeout=0.3)
    s = _wait_idle(server.engine)
    assert s["num_running"] == 0 and s["kv_blocks_used"] == 0
    assert _metric_value(server, "flowrt_requests_aborted_total") >= aborted_before + 1


# ---- metrics -----------------------------------------------------------------------------------------------


def test_metrics_and_health_are_open_with_an_api_key(server, client):
    """Issue 39 item 16, as the README says: --api-key guards /v1; /metrics and /health stay open (Prometheus
    scrapers and health checks carry no key), and they hold counts and timings, never a request's text or user."""
    client.completions.create(model=MODEL, prompt="zebra-prompt", max_tokens=2, user="user-zebra")
    assert httpx.get(server.url + "/v1/models").status_code == 401
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and "flowrt_http_requests_total" in r.text
    assert "zebra" not in r.text
    assert httpx.get(server.url + "/health").status_code == 200


def test_metrics_parse(server, client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    # one request of each refused kind, so the test stands alone (not only after the error tests above)
    url = server.url + "/v1/completions"
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    _error(httpx.post(url, headers=_auth(), json={**body, "max_tokens": 600}), 400)
    _error(httpx.post(url, json=body), 401)
    _error(httpx.post(url, headers=_auth(), json={**body, "model": "gpt-4o"}), 404)
    _error(httpx.post(url, headers=_auth(), json={**body, "prompt": "x" * (MAX_BODY + 10)}), 413)
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("flowrt_http_requests", "flowrt_prompt_tokens", "flowrt_generation_tokens",
                 "flowrt_prefix_cache_hit_tokens", "flowrt_engine_prefix_cache_hit_tokens", "flowrt_kv_blocks_used",
                 "flowrt_kv_blocks_total", "flowrt_requests_running", "flowrt_requests_waiting",
                 "flowrt_time_to_first_token_seconds", "flowrt_inter_token_latency_seconds"):
        assert name in fams, name
    statuses = {s.labels["status"] for s in fams["flowrt_http_requests"].samples if s.name.endswith("_total")}
    assert {"200", "400", "401", "404", "413"} <= statuses
    assert fams["flowrt_kv_blocks_total"].samples[0].value > 0
    ttft_count = [s.value for s in fams["flowrt_time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert ttft_count[0] > 0
    assert [s.value for s in fams["flowrt_generation_tokens"].samples if s.name.endswith("_total")][0] > 0


# ---- requests refused before anything starts ------------------------------------------------------------


def test_seed_out_of_range_is_400(server):
    for seed in (2**64, -(2**63) - 1):
        for stream in (False, True):
            r = httpx.post(server.url + "/v1/completions", headers=_auth(), timeout=30,
                           json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "seed": seed, "stream": stream})
            err = _error(r, 400)
            assert err["param"] == "seed", err
    r = httpx.post(server.url + "/v1/completions", headers=_auth(), timeout=30,
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "seed": 2**63 - 1, "n": 2})
    assert r.status_code == 200, r.text


def test_streaming_prompt_errors_come_before_the_stream(server):
    url = server.url + "/v1/completions"
    for prompt, code in ((PROMPT_IDS * 110, "context_length_exceeded"), ([], None), ([[]], None),
                         ([PROMPT, [10**6]], None)):
        r = httpx.post(url, headers=_auth(), timeout=30,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True})
        err = _error(r, 400)  # a JSON error, not a 200 event stream carrying one
        assert err["param"] == "prompt" and (code is None or err["code"] == code), err


def test_prompt_that_cannot_fit_the_kv_pool_is_400_before_the_stream(tiny_pool_server):
    url = tiny_pool_server.url + "/v1/completions"
    for stream in (False, True):
        r = httpx.post(url, timeout=30, json={"model": MODEL, "prompt": PROMPT, "max_tokens": 100, "stream": stream,
                                              "ignore_eos": True})
        err = _error(r, 400)
        assert "64" in err["message"] or "4 blocks" in err["message"] or "KV" in err["message"], err
    r = httpx.post(url, timeout=30, json={"model": MODEL, "prompt": PROMPT, "max_tokens": 30, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == GREEDY_30
    assert _wait_idle(tiny_pool_server.engine)["num_running"] == 0


def test_chunked_body_over_the_limit_is_413(server):
    def chunks(total, size=1 << 20):
        sent = 0
        while sent < total:
            yield b" " * min(size, total - sent)
            sent += size

    url = server.url + "/v1/completions"
    try:
        r = httpx.post(url, headers={**_auth(), "content-type": "application/json"}, content=chunks(50 << 20),
                       timeout=60)
    except httpx.TransportError:
        pytest.fail("the server dropped the connection instead of answering 413")
    err = _error(r, 413)
    assert err["code"] == "request_too_large"
    # a chunked body under the limit is served as usual
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 30, "temperature": 0}).encode()
    r = httpx.post(url, headers={**_auth(), "content-type": "application/json"}, content=iter([body[:10], body[10:]]),
                   timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == GREEDY_30


def test_user_field_is_the_program_id(server, client):
    """The OpenAI `user` field names the program a request belongs to (program-aware scheduling)."""
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, user="alice")
    stats = server.engine.run_stats("user:alice")
    assert stats is not None and stats["requests"] == 1 and stats["service_tokens"] > 0
    assert server.engine.run_stats("user:bob") is None
