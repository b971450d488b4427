"""`flowrt serve` as a process: starts on a free loopback port, serves, and on SIGTERM drains (in-flight
requests finish, /health answers 503, streams past the grace period end with a final chunk and [DONE]),
then exits 0; a second signal exits at once."""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest
from support import ROOT, STORIES

SLEEPY = textwrap.dedent('''
    import asyncio
    import flowrt as fr

    wf = fr.Workflow("sleepy")

    @wf.step
    async def nap(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "rested"
''')
posix_only = pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")


class ServeProcess:
    """`flowrt serve` on stories260K in a subprocess, on a free port; its output is kept in `lines`."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "flowrt.cli", "serve", "--model", str(STORIES),
                                      "--port", "0", "--dtype", "float32", "--served-model-name", "stories", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self.url = ""
        started = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line)
                m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line)
                if m:
                    self.url = m.group(1)
                    started.set()

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        assert started.wait(120), self.log

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def signal(self, sig=signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self.reader.join(5)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _stream_lines(url: str, body: dict, out: list[str], started: threading.Event) -> None:
    """Reads an SSE response into `out` (non-empty lines), setting `started` at the first event."""
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        out.append(f"status {r.status_code}")
        for line in r.iter_lines():
            if line:
                out.append(line)
                started.set()


def _wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_serve_help_is_registered_on_flowrt_cli():
    from flowrt.cli.commands import build_parser

    args = build_parser().parse_args(["serve", "--model", str(STORIES), "--port", "0", "--api-key", "k",
                                      "--served-model-name", "m", "--num-kv-blocks", "64", "--dtype", "float32"])
    assert args.port == 0 and args.api_key == "k" and args.num_kv_blocks == 64 and args.host == "127.0.0.1"
    assert args.trust_request_chat_template is False and args.chat_template_timeout > 0
    assert callable(args.func)


@pytest.mark.slow
def test_serve_help_describes_the_command_for_users():
    out = subprocess.run([sys.executable, "-m", "flowrt.cli", "serve", "--help"], capture_output=True, text=True,
                         check=True, env={**os.environ, "COLUMNS": "200"}).stdout
    for endpoint in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/workflows/NAME/runs",
                     "/health", "/metrics"):
        assert endpoint in out, endpoint
    assert "SIGTERM" in out and "OpenAI-compatible" in out
    assert "registers the subcommand" not in out  # the developer docstring is not the user's help
    from flowrt.server.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert [a.option_strings for a in parser._actions if not a.help] == []  # every flag says what it does


@pytest.mark.slow
@posix_only
def test_serve_process_graceful_sigterm():
    srv = ServeProcess("--graceful-timeout", "20")
    try:
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"
        body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        events: list[str] = []
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 2:
                    srv.signal()  # shutdown starts while the stream is running
        assert events[-1] == "data: [DONE]"
        assert '"completion_tokens":300' in events[-2]  # the in-flight request finished in full
        assert srv.wait(60) == 0, srv.log
        assert "Shutting down" in srv.log and "waiting up to 20 s for 1 in-flight request" in srv.log, srv.log
        assert "Traceback" not in srv.log, srv.log
    finally:
        srv.kill()
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health")


@pytest.mark.slow
@posix_only
def test_drain_answers_503_and_ends_streams_past_the_grace_period(tmp_path):
    sleepy = tmp_path / "sleepy.py"
    sleepy.write_text(SLEEPY)
    # one sequence at a time: 32 prompts of 500 tokens outlive a 2 s grace period
    srv = ServeProcess("--graceful-timeout", "2", "--max-num-seqs", "1", "--workflow", str(sleepy),
                       str(ROOT / "workflows" / "self_consistency.py"), str(ROOT / "workflows" / "map_reduce.py"))
    try:
        # two shipped examples (both `wf = fr.Workflow(...)`) served side by side, by their Workflow names
        ids = {w["id"] for w in httpx.get(srv.url + "/v1/workflows").json()["data"]}
        assert ids == {"sleepy", "self-consistency", "map-reduce"}
        completion, run = [], []
        c_started, r_started = threading.Event(), threading.Event()
        body = {"model": "stories", "prompt": ["Once upon a time"] * 32, "max_tokens": 500, "temperature": 0,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        threads = [threading.Thread(target=_stream_lines, args=(srv.url + "/v1/completions", body, completion,
                                                                c_started)),
                   threading.Thread(target=_stream_lines, args=(srv.url + "/v1/workflows/sleepy/runs",
                                                                {"inputs": {"seconds": 60}, "stream": True}, run,
                                                                r_started))]
        for t in threads:
            t.start()
        assert c_started.wait(30) and r_started.wait(30)
        srv.signal()
        # draining: the socket still answers, /health and new requests say 503
        _wait_for(lambda: httpx.get(srv.url + "/health").status_code == 503)
        assert httpx.get(srv.url + "/health").json()["status"] == "shutting_down"
        r = httpx.post(srv.url + "/v1/completions", json={"model": "stories", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        for t in threads:
            t.join(60)
        assert srv.wait(60) == 0, srv.log
    finally:
        srv.kill()
    # the completion stream closed properly: the aborted choices' final chunks, usage, [DONE]
    assert completion[0] == "status 200" and completion[-1] == "data: [DONE]", completion[-3:]
    chunks = [json.loads(line[6:]) for line in completion[1:-1]]
    finishes = [c["finish_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]]
    assert len(finishes) == 32 and "abort" in finishes, finishes
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] < 32 * 500
    # the workflow stream too: an error event saying why, then [DONE]
    assert run[0] == "status 200" and run[-1] == "data: [DONE]", run
    assert "shut down before the workflow run finished" in json.loads(run[-2][6:])["error"]["message"]
    assert "Grace period over" in srv.log and "Traceback" not in srv.log, srv.log


@pytest.mark.slow
@posix_only
def test_second_signal_exits_at_once(tmp_path):
    sleepy = tmp_path / "sleepy.py"
    sleepy.write_text(SLEEPY)
    srv = ServeProcess("--graceful-timeout", "120", "--workflow", str(sleepy))
    try:
        out, started = [], threading.Event()
        t = threading.Thread(target=_stream_lines, daemon=True,
                             args=(srv.url + "/v1/workflows/sleepy/runs", {"inputs": {"seconds": 120}, "stream": True},
                                   out, started))
        t.start()
        assert started.wait(30)
        srv.signal()
        _wait_for(lambda: httpx.get(srv.url + "/health").status_code == 503)
        t0 = time.monotonic()
        srv.signal(signal.SIGINT)
        assert srv.wait(15) == 1, srv.log
        assert time.monotonic() - t0 < 10
        assert "exiting now" in srv.log, srv.log
    finally:
        srv.kill()
