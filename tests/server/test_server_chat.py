"""/v1/chat/completions on a tiny random Llama whose tokenizer has a ChatML chat template.

The model is built in the test (stories260K's tokenizer + a chat template, random weights), so its output
is noise: the tests check the protocol (template, streaming, usage, n, logprobs, cached tokens), not text.
"""

import threading
import time

import httpx
import openai
import pytest

from support import make_chat_model, serve_model

MODEL = "tiny-chat"
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SYSTEM = "You are a helpful assistant who tells short stories about a little girl named Lily and her dog. " * 2
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me a story."}]
# 4e8 loop iterations: minutes of CPU if it were ever rendered
HOSTILE = "{% for i in range(20000) %}{% for j in range(20000) %}{% endfor %}{% endfor %}x"
# a few seconds of CPU, then the last message
TEMPLATE_CAP_S = 2.0  # the trusting server's render cap: a /health call waiting out a render would take about this
SLOW = "{% for i in range(100000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}{{ messages[-1]['content'] }}"
TEMPLATE_THREAD = "flowrt-chat-template"


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("tiny-chat"), CHATML)


@pytest.fixture(scope="module")
def server(chat_model_dir):
    yield from serve_model(chat_model_dir, served_model_name=MODEL, model_path=str(chat_model_dir))


@pytest.fixture(scope="module")
def trusting_server(chat_model_dir):
    yield from serve_model(chat_model_dir, served_model_name=MODEL, trust_request_chat_template=True,
                           chat_template_timeout=TEMPLATE_CAP_S)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _prompt_len(server, messages):
    text = server.engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    return len(server.engine.tokenizer.encode(text, add_special_tokens=False))


def test_chat_completion(server, client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.model == MODEL
    (c,) = r.choices
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason == "length"
    assert r.usage.prompt_tokens == _prompt_len(server, MESSAGES)
    assert r.usage.completion_tokens == 8
    # max_completion_tokens is the newer name of max_tokens
    r2 = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert r2.choices[0].message.content == c.message.content
    # content given as text parts is the same prompt
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "Tell me "},
                                                        {"type": "text", "text": "a story."}]}]
    r3 = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert r3.choices[0].message.content == c.message.content


def test_chat_stream_with_usage(server, client):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 10
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt ran just before


def test_chat_cached_tokens_for_shared_system_prompt(client):
    first = [{"role": "system", "content": SYSTEM + " Be brief."}, {"role": "user", "content": "Hello?"}]
    second = [{"role": "system", "content": SYSTEM + " Be brief."}, {"role": "user", "content": "A poem?"}]
    client.chat.completions.create(model=MODEL, messages=first, max_tokens=2)
    r = client.chat.completions.create(model=MODEL, messages=second, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16


def test_chat_n2_stream_interleaves(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=1.0,
                                                 seed=3, n=2, stream=True, extra_body={"ignore_eos": True}))
    seen = [c.choices[0].index for c in chunks if c.choices]
    assert set(seen) == {0, 1}
    finished = sorted(ch.index for c in chunks for ch in c.choices if ch.finish_reason)
    assert finished == [0, 1]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=1.0, seed=3, n=2,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 12


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)  # greedy
        assert entry.bytes == list(entry.token.encode())
    assert "".join(e.token for e in content) == r.choices[0].message.content
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, logprobs=False)
    assert r.choices[0].logprobs is None


def test_chat_errors(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
    assert "role" in e.value.body["param"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 600}])
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=MESSAGES)
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                               "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def _template_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == TEMPLATE_THREAD]


def test_request_chat_template_refused_by_default(server):
    url = server.url + "/v1/chat/completions"
    for extra, param in (({"chat_template_kwargs": {"chat_template": HOSTILE}}, "chat_template_kwargs.chat_template"),
                         ({"chat_template": "{{ 'x' }}"}, "chat_template")):
        t0 = time.monotonic()
        r = httpx.post(url, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **extra}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == "chat_template_not_allowed"
        assert "--trust-request-chat-template" in err["message"]
        assert time.monotonic() - t0 < 5  # refused without rendering it
    assert httpx.get(server.url + "/health").status_code == 200


def test_trusted_request_template_is_capped_off_the_event_loop(trusting_server):
    url = trusting_server.url + "/v1/chat/completions"
    tok = trusting_server.engine.tokenizer
    r = httpx.post(url, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2,
                              "chat_template": "{{ messages[-1]['content'] }}"}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode("Tell me a story.", add_special_tokens=False))

    result = {}

    def slow():
        result["r"] = httpx.post(url, json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2,
                                            "chat_template_kwargs": {"chat_template": SLOW}}, timeout=60)

    caller = threading.Thread(target=slow)
    caller.start()
    deadline = time.monotonic() + 10
    while not _template_threads():  # the server (in this process) renders in its own thread
        assert time.monotonic() < deadline and caller.is_alive()
        time.sleep(0.01)
    latencies = []
    while caller.is_alive():  # /health answers while the template renders
        t0 = time.monotonic()
        assert httpx.get(trusting_server.url + "/health", timeout=10).status_code == 200
        latencies.append(time.monotonic() - t0)
    caller.join()
    # on the event loop a call would wait out the render (~TEMPLATE_CAP_S); half of it leaves a loaded machine's
    # scheduling delays room (a 0.8 s bound against a 1 s cap failed once in a full fast-tier run on 2 cores)
    assert latencies and max(latencies) < TEMPLATE_CAP_S / 2, latencies
    r = result["r"]
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "chat_template_timeout" and err["param"] == "chat_template_kwargs.chat_template"
    deadline = time.monotonic() + 5
    while _template_threads():  # the cap stopped the rendering, it does not run on in the background
        assert time.monotonic() < deadline, "the template kept rendering after its request got a 400"
        time.sleep(0.02)
