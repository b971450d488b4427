#!/usr/bin/env python
"""`flowrt serve` under load: N concurrent streaming clients (8, 32, 64 by default) against the default model.

    python bench/serve.py [--concurrency 8 32 64] [--requests-per-client 2] [--dtype bfloat16] [--json out.json]
    python bench/serve.py --url http://127.0.0.1:8000 --model NAME     # an already running OpenAI-compatible server

Starts `python -m flowrt.server` (the default model: SmolLM2-135M-Instruct) on a free loopback port in a
subprocess, so that the load generator does not share its interpreter. Each client runs a closed loop of
streaming /v1/completions requests with mixed lengths: random token-id prompts of 32-256 tokens and 16-128
new tokens (EOS ignored, so every request generates exactly that many). Measured at the client:
requests/s and generated tokens/s over the level's wall time, time to first token (TTFT) and inter-token
latency (ITL, the gaps between streamed tokens) at p50 / p99.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def workload(n: int, seed: int, vocab: int, pmin=32, pmax=256, gmin=16, gmax=128) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": [rng.randrange(3, vocab) for _ in range(rng.randint(pmin, pmax))],
             "max_tokens": rng.randint(gmin, gmax)} for _ in range(n)]


async def one_request(client: httpx.AsyncClient, url: str, model: str, req: dict, stats: dict) -> None:
    body = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0.8,
            "top_p": 0.95, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    last = None
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            stats["errors"].append(f"{r.status_code}: {(await r.aread())[:200]!r}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # the server failed the request after the stream started
                stats["errors"].append(chunk["error"].get("message"))
                return
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if not chunk["choices"] or not chunk["choices"][0]["text"]:
                continue
            now = time.perf_counter()
            if last is None:
                stats["ttft"].append(now - t0)
            else:
                stats["itl"].append(now - last)
            last = now
    if tokens != req["max_tokens"]:
        stats["errors"].append(f"expected {req['max_tokens']} tokens, got {tokens}")
    stats["tokens"] += tokens
    stats["done"] += 1


async def run_level(url: str, model: str, concurrency: int, per_client: int, vocab: int, seed: int) -> dict:
    reqs = workload(concurrency * per_client, seed + concurrency, vocab)
    stats = {"ttft": [], "itl": [], "tokens": 0, "done": 0, "errors": []}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def worker(i: int) -> None:
            for req in reqs[i::concurrency]:
                await one_request(client, url, model, req, stats)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        wall = time.perf_counter() - t0
    ms = 1000.0
    return {
        "concurrency": concurrency, "requests": stats["done"], "wall_s": round(wall, 2),
        "requests_per_s": round(stats["done"] / wall, 3), "gen_tokens_per_s": round(stats["tokens"] / wall, 1),
        "ttft_p50_ms": round(percentile(stats["ttft"], 50) * ms, 1),
        "ttft_p99_ms": round(percentile(stats["ttft"], 99) * ms, 1),
        "itl_p50_ms": round(percentile(stats["itl"], 50) * ms, 2),
        "itl_p99_ms": round(percentile(stats["itl"], 99) * ms, 2),
        "errors": stats["errors"][:5], "num_errors": len(stats["errors"]),
    }


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "flowrt.server", "--port", str(port), "--log-level", "warning",
           "--served-model-name", args.model]
    if args.server_model:
        cmd += ["--model", args.server_model]
    for opt in ("dtype", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "attention_backend", "device"):
        value = getattr(args, opt)
        if value is not None:
            cmd += ["--" + opt.replace("_", "-"), str(value)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError("the server did not come up")
        time.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--url", help="benchmark this running server instead of starting flowrt serve")
    ap.add_argument("--model", default="default", help="model name sent in requests")
    ap.add_argument("--server-model", metavar="PATH", help="model the started server loads (default: the default model)")
    ap.add_argument("--vocab", type=int, default=49152, help="token ids are drawn from [3, vocab)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    for opt in ("dtype", "attention_backend", "device"):
        ap.add_argument("--" + opt.replace("_", "-"), dest=opt)
    for opt in ("num_kv_blocks", "max_num_seqs", "max_num_batched_tokens"):
        ap.add_argument("--" + opt.replace("_", "-"), dest=opt, type=int)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sysinfo import banner

    print(banner(args.dtype or "auto", "server: " + (args.url or "flowrt serve")), flush=True)

    proc = None
    url = args.url
    if url is None:
        t = time.perf_counter()
        proc, url = start_server(args)
        print(f"server up in {time.perf_counter() - t:.1f} s at {url}", file=sys.stderr)
    try:
        # warm-up (first-call costs are not part of any level)
        asyncio.run(run_level(url, args.model, 2, 1, args.vocab, args.seed - 1))
        results = []
        print(f"{'clients':>7} {'reqs':>5} {'wall s':>7} {'req/s':>7} {'gen tok/s':>9} {'TTFT p50':>9} "
              f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}  (ms)")
        for c in args.concurrency:
            r = asyncio.run(run_level(url, args.model, c, args.requests_per_client, args.vocab, args.seed))
            results.append(r)
            print(f"{c:>7} {r['requests']:>5} {r['wall_s']:>7} {r['requests_per_s']:>7} {r['gen_tokens_per_s']:>9} "
                  f"{r['ttft_p50_ms']:>9} {r['ttft_p99_ms']:>9} {r['itl_p50_ms']:>8} {r['itl_p99_ms']:>8}"
                  + (f"  errors: {r['num_errors']} {r['errors'][:1]}" if r["num_errors"] else ""), flush=True)
        try:
            metrics = httpx.get(url + "/metrics", timeout=10).text
            cache = [ln for ln in metrics.splitlines() if ln.startswith(("flowrt_kv_blocks_total ",
                                                                          "flowrt_kv_blocks_peak ",
                                                                          "flowrt_engine_preemptions_total "))]
            print("server:", "; ".join(cache), file=sys.stderr)
        except httpx.HTTPError:
            pass
        if args.json:
            Path(args.json).write_text(json.dumps({"url": url, "results": results}, indent=2))
        return 1 if any(r["num_errors"] for r in results) else 0
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    sys.exit(main())
