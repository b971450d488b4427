"""A lone surrogate (JSON's "\\ud800" without its low half) in a request is a 400 naming the field, on every
endpoint, never a 500 from the tokenizer (issue 27, item 3). The bodies are sent as raw bytes: a JSON encoder
would refuse to write such a string, but clients (and attackers) send the escape as it is."""

import textwrap

import httpx
import pytest
from support import make_chat_model, serve_model

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORKFLOW = textwrap.dedent('''
    import flowrt as fr
    wf = fr.Workflow("echo")

    @wf.step
    def shout(text: str) -> str:
        return text.upper()
''')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from flowrt.server.workflows import load_workflows

    d = tmp_path_factory.mktemp("unicode")
    (d / "echo.py").write_text(WORKFLOW)
    model = make_chat_model(d / "model", CHATML)
    yield from serve_model(model, served_model_name="tiny", workflows=load_workflows([str(d / "echo.py")]))


def _post(server, path: str, body: str) -> httpx.Response:
    return httpx.post(server.url + path, content=body.encode(), headers={"content-type": "application/json"},
                      timeout=60)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", r'{"model": "tiny", "messages": [{"role": "user", "content": "hi \ud800"}]}',
     "messages[0].content"),
    ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "ok"}], "stream": true,'
                             r' "stop": ["a", "\udc00b"]}', "stop[1]"),
    ("/v1/completions", r'{"model": "tiny", "prompt": "hi \ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", r'{"prompt": ["fine", "\ud83d"], "max_tokens": 2}', "prompt[1]"),
    ("/v1/workflows/echo/runs", r'{"inputs": {"text": "hi \ud800"}}', "inputs.text"),
    ("/v1/workflows/echo/runs", r'{"inputs": {"te\ud800xt": "hi"}}', r"inputs.te\ud800xt"),  # in a key
])
def test_lone_surrogate_is_400_naming_the_field(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert param in err["message"] and "lone surrogate" in err["message"]


def test_a_surrogate_pair_is_fine(server):
    r = _post(server, "/v1/chat/completions",
              r'{"messages": [{"role": "user", "content": "hi \ud83d\ude00"}], "max_tokens": 2}')
    assert r.status_code == 200, r.text
    r = _post(server, "/v1/workflows/echo/runs", r'{"inputs": {"text": "hi \ud83d\ude00"}}')
    assert r.status_code == 200, r.text
