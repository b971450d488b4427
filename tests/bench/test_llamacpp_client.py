"""bench/llamacpp.py's client and workloads, without a server: the streamed chunks are counted and timed as
both servers send them (llama-server's final chunk carries usage and empty text), a wrong output length is an
error, and the prompts are the same for either server."""

import asyncio
import json
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from llamacpp import WORKLOADS  # noqa: E402
from oai_stream import run_load  # noqa: E402


def _sse(n_tokens: int, prompt_tokens: int) -> bytes:
    chunks = [{"choices": [{"text": f" t{i}", "index": 0, "finish_reason": None}]} for i in range(n_tokens)]
    chunks.append({"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                   "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n_tokens}})
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _server(short_by: int = 0):
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0.0
        return httpx.Response(200, content=_sse(body["max_tokens"] - short_by, len(body["prompt"].split())),
                              headers={"content-type": "text/event-stream"})
    return httpx.MockTransport(handle)


def test_counts_tokens_and_prompt_lengths():
    r = asyncio.run(run_load("http://x", "m", [" a b c", " d e"], 5, 2, transport=_server()))
    assert not r.errors and r.output_tokens == 10 and r.prompt_token_range == (2, 3)
    assert r.median_tpot_s is not None and r.output_tok_s > 0


def test_a_short_answer_is_an_error():
    r = asyncio.run(run_load("http://x", "m", [" a"], 5, 1, transport=_server(short_by=1)))
    assert r.errors == ["asked for 5 tokens, got 4"]


def test_workload_prompts_repeat_with_the_seed_and_share_their_prefix():
    words = [f"w{i}" for i in range(200)]
    wl = WORKLOADS["shared32"].scaled(3, 4)
    a, b = wl.prompts(words, 7), wl.prompts(words, 7)
    assert a == b and wl.concurrency == 3 and wl.output_tokens == 4
    assert all(len(p.split()) == 544 and p.split()[:512] == a[0].split()[:512] for p in a)
    assert len({p for p in a}) == 3
