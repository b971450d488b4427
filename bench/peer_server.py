"""An HTTP model server run as a subprocess for a benchmark: started on a free loopback port, awaited on
/health, measured from /proc, stopped. Two kinds: `flowrt serve` and llama.cpp's `llama-server`.

Each server writes its log to a file (a pipe nobody reads would block it); the weight bytes a server reports
come from there (llama-server's "model buffer size" lines) or from its /metrics (any flowrt metric whose name
has ``weights_bytes``).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "bench"  # the served model name both kinds are given


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Memory:
    """From /proc/PID/status, in bytes: all resident, anonymous (heap: weights a server copied), file-backed
    (mmapped model files), and the peak resident."""
    vm_rss: int
    rss_anon: int
    rss_file: int
    vm_hwm: int

    @classmethod
    def of(cls, pid: int) -> "Memory":
        fields = {}
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
        return cls(fields["VmRSS"], fields["RssAnon"], fields["RssFile"], fields["VmHWM"])


@dataclass
class ServerSpec:
    kind: str             # "flowrt" or "llama.cpp"
    command: list[str]
    url: str


def flowrt_spec(gguf: Path, extra_args: list[str]) -> ServerSpec:
    port = free_port()
    cmd = [sys.executable, "-m", "flowrt.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", MODEL_NAME, "--log-level", "warning", *extra_args]
    return ServerSpec("flowrt", cmd, f"http://127.0.0.1:{port}")


def llamacpp_spec(gguf: Path, bin_dir: Path, threads: int, slots: int, context: int,
                  extra_args: list[str]) -> ServerSpec:
    port = free_port()
    cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(context), "--alias", MODEL_NAME,
           "-lv", "4",  # b11434 logs its "model buffer size" lines at debug level only (a few lines per request)
           *extra_args]
    return ServerSpec("llama.cpp", cmd, f"http://127.0.0.1:{port}")


class RunningServer:
    def __init__(self, spec: ServerSpec, log_path: Path, start_timeout_s: float = 600.0):
        self.spec = spec
        self.log_path = log_path
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self._log = open(log_path, "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(spec.command, cwd=str(ROOT), env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        try:
            self._wait_healthy(start_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - t0

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.kind} exited with {self.proc.returncode}; its log:\n"
                                   + self.log_path.read_text()[-3000:])
            try:  # llama-server answers 503 while it loads the model
                if httpx.get(self.spec.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.spec.kind} did not answer /health within {timeout_s:.0f} s")

    @property
    def url(self) -> str:
        return self.spec.url

    def memory(self) -> Memory:
        return Memory.of(self.proc.pid)

    def reported_weights_bytes(self) -> dict[str, int]:
        """The weight bytes the server itself reports, by where it reports them ({} if it reports none)."""
        if self.spec.kind == "llama.cpp":
            found = {}
            for m in re.finditer(r"(\S+) model buffer size\s*=\s*([\d.]+) MiB", self.log_path.read_text()):
                found[m.group(1)] = found.get(m.group(1), 0) + int(float(m.group(2)) * 2**20)
            return found
        try:
            text = httpx.get(self.spec.url + "/metrics", timeout=10).text
        except httpx.HTTPError:
            return {}
        return {m.group(1): int(float(m.group(2)))
                for m in re.finditer(r"^(\w*weights_bytes\w*)(?:\{[^}]*\})? ([\d.e+]+)$", text, re.M)}

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> "RunningServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
