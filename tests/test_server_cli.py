"""`flowrt serve` as a process: starts on a free loopback port, serves, and on SIGTERM lets an in-flight
stream finish, then exits 0."""

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

STORIES = Path(__file__).parent / "models" / "stories260K"


def test_serve_help_is_registered_on_flowrt_cli():
    from flowrt.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", str(STORIES), "--port", "0", "--api-key", "k",
                                      "--served-model-name", "m", "--num-kv-blocks", "64", "--dtype", "float32"])
    assert args.port == 0 and args.api_key == "k" and args.num_kv_blocks == 64 and args.host == "127.0.0.1"
    assert callable(args.func)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
def test_serve_process_graceful_sigterm():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "flowrt.cli", "serve", "--model", str(STORIES), "--port", "0",
                             "--dtype", "float32", "--served-model-name", "stories", "--graceful-timeout", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    port_found = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line):
                port_found.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert port_found.wait(120), "".join(lines)
        port = int(re.search(r"127\.0\.0\.1:(\d+)", next(x for x in lines if "Uvicorn running" in x)).group(1))
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health").json()["status"] == "ok"
        body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        events: list[str] = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 2:
                    proc.send_signal(signal.SIGTERM)  # shutdown starts while the stream is running
        assert events[-1] == "data: [DONE]"
        assert '"completion_tokens":300' in events[-2]  # the in-flight request finished in full
        assert proc.wait(60) == 0, "".join(lines)
        reader.join(5)
        log = "".join(lines)
        assert "Shutting down" in log and "Waiting for connections to close" in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health")
