"""One load generator for every OpenAI-compatible server: streaming /v1/completions, timed at the client.

Each request asks for exactly its output length (``max_tokens`` with ``ignore_eos``; llama-server and flowrt
serve both accept ``ignore_eos`` in the body) at temperature 0. Tokens are timed by the streamed chunks: time to
first token, then the time per output token after the first (TPOT = (last - first) / (tokens - 1)). The token
counts come from the server's usage where it sends one, else from the chunks that carried text.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class RequestResult:
    prompt_tokens: int | None   # as the server counted them (usage), None if it sent no usage
    completion_tokens: int
    ttft_s: float
    tpot_s: float | None        # None for a single-token answer
    error: str | None = None


@dataclass
class LoadResult:
    """A batch of requests sent with at most `concurrency` in flight."""
    concurrency: int
    wall_s: float
    requests: list[RequestResult] = field(default_factory=list)

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.requests if r.error is None]

    @property
    def errors(self) -> list[str]:
        return [r.error for r in self.requests if r.error is not None]

    @property
    def output_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.ok)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def median_tpot_s(self) -> float | None:
        xs = [r.tpot_s for r in self.ok if r.tpot_s is not None]
        return statistics.median(xs) if xs else None

    @property
    def median_ttft_s(self) -> float | None:
        xs = [r.ttft_s for r in self.ok]
        return statistics.median(xs) if xs else None

    @property
    def prompt_token_range(self) -> tuple[int, int] | None:
        xs = [r.prompt_tokens for r in self.ok if r.prompt_tokens is not None]
        return (min(xs), max(xs)) if xs else None


async def stream_completion(client: httpx.AsyncClient, url: str, model: str, prompt: str,
                            max_tokens: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    chunks, usage = 0, None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return RequestResult(None, 0, 0.0, None, f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return RequestResult(None, chunks, 0.0, None, str(chunk["error"])[:200])
            usage = chunk.get("usage") or usage
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                last = time.perf_counter()
                first = first or last
                chunks += 1
    n = usage["completion_tokens"] if usage else chunks
    if first is None:
        return RequestResult(None, 0, 0.0, None, "no tokens streamed")
    error = None if n == max_tokens else f"asked for {max_tokens} tokens, got {n}"
    tpot = (last - first) / (n - 1) if n > 1 else None
    return RequestResult(usage.get("prompt_tokens") if usage else None, n, first - t0, tpot, error)


async def run_load(url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int,
                   timeout_s: float = 900.0, transport: httpx.AsyncBaseTransport | None = None) -> LoadResult:
    """Sends every prompt, `concurrency` at a time (closed loop: a worker sends its next when one ends).
    `transport` replaces the network (tests)."""
    # a fresh connection per request: llama-server's HTTP library drops reused idle connections at its own pace,
    # and on loopback a connect costs microseconds
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=0)
    queue = list(reversed(prompts))
    results: list[RequestResult] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, transport=transport) as client:
        async def worker() -> None:
            while queue:
                try:
                    results.append(await stream_completion(client, url, model, queue.pop(), max_tokens))
                except httpx.HTTPError as e:  # recorded like any failed request: the run goes on
                    results.append(RequestResult(None, 0, 0.0, None, f"{type(e).__name__}: {e}"[:200]))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
        wall = time.perf_counter() - t0
    return LoadResult(concurrency, wall, results)
