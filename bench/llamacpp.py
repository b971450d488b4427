#!/usr/bin/env python
"""flowrt serve against llama.cpp's llama-server on the same GGUF file, through one client (issue 33).

    python bench/llamacpp.py --gguf /tmp/quant135m/smollm2-135m-q8_0.gguf --gguf /tmp/quant135m/smollm2-135m-q4_k_m.gguf \
        --rounds 2 --json out.json
    python bench/llamacpp.py --requests 4 --output-tokens 16          # smoke test on the shipped Q4_1 file

Workloads (--workloads, comma-separated; the issue's three):
  single    one request at a time, 128 prompt tokens in / 128 out: output tok/s and median TPOT
  batch64   64 at once, random 256 in / 64 out: output tok/s
  shared32  32 at once, 512 shared + 32 own tokens in / 32 out: output tok/s

Every (file, server, workload) gets a fresh server process: llama-server needs one slot per concurrent request
(``-np``, with ``-c`` = slots x the longest request, so each slot holds its own), and a fresh flowrt keeps the
prefix cache of one workload from the next. The servers run one after the other, never at once; ``--rounds N``
repeats the list with the order of the two servers alternating, and the table shows medians over rounds.
Each server gets a short warm-up request before the timed ones. Prompts are random single-token words
(bench/word_prompts.py), the same for both servers; the servers' usage.prompt_tokens is printed to confirm the
lengths. Output lengths are exact (``ignore_eos``); a request that returns another count is an error.

After each workload the server's resident memory is read from /proc (VmRSS, RssAnon: copied weights and
buffers, RssFile: mmapped model files), with the weight bytes the server reports itself: llama-server's
"model buffer size" log lines, flowrt's ``weights_bytes`` metric where it has one.

The files of the issue's table (not in the repository; regenerate them, llama.cpp built first with
../shared/peers/build_llamacpp.sh /tmp/llamacpp, tag b11434):

    Q=/tmp/llamacpp/bin/llama-quantize; S=$(python -c 'from flowrt.engine import default_model_path as d; print(d())')
    mkdir -p /tmp/quant135m /tmp/quant1b && cp "$S" /tmp/quant135m/smollm2-135m-q4_1.gguf
    for t in F32 Q8_0 Q4_K_M; do $Q --allow-requantize "$S" /tmp/quant135m/smollm2-135m-${t,,}.gguf $t; done
    python bench/make_llama_gguf.py /tmp/quant1b/llama1b-f16.gguf       # random weights, SmolLM2's tokenizer
    for t in Q8_0 Q4_K_M; do $Q /tmp/quant1b/llama1b-f16.gguf /tmp/quant1b/llama1b-${t,,}.gguf $t; done

The 135M F32 file is dequantized from Q4_1 (llama.cpp's F32 baseline reads those bytes); its Q8_0 and Q4_K_M
are requantized from Q4_1, so they carry Q4_1's rounding plus their own; speed does not care. Know what the
135M "Q4_K_M" holds: its hidden size (576) is not a multiple of 256, so llama-quantize falls back to Q5_0 for
every tensor whose rows are 576 long (166 of them) and Q8_0 for attn_v; only ffn_down (rows of 1,536) is Q4_K /
Q6_K (16 + 14 tensors). The 1B shape is the real K-quant case: Q4_K 96 tensors, Q6_K 17 (token_embd, tied, and
half the attn_v / ffn_down), F32 norms. On AVX2 llama-server repacks Q4_0 / Q4_K / IQ4_NL weights into
interleaved rows at load (its CPU_REPACK buffer, anonymous memory) besides the mmapped file.

The issue's table, two rounds, the 135M files and the 1B shape as separate runs (from PEERS.md's Zen2 rates, a
rough estimate: tens of minutes for the 135M files, a few hours for the 1B ones, mostly llama.cpp's batched
prefill and flowrt's float32 1B decode):

    python bench/llamacpp.py --gguf /tmp/quant135m/*.gguf --rounds 2 --json llamacpp-135m.json
    python bench/llamacpp.py --gguf /tmp/quant1b/llama1b-q8_0.gguf /tmp/quant1b/llama1b-q4_k_m.gguf \
        --rounds 2 --json llamacpp-1b.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from oai_stream import LoadResult, run_load  # noqa: E402
from peer_server import MODEL_NAME, Memory, RunningServer, flowrt_spec, llamacpp_spec  # noqa: E402
from word_prompts import WordPrompts, vocabulary_words  # noqa: E402

SERVERS = ("flowrt", "llama.cpp")


@dataclass(frozen=True)
class Workload:
    name: str
    concurrency: int
    requests: int
    own_tokens: int       # prompt tokens of each request's own
    output_tokens: int
    shared_tokens: int = 0  # prompt tokens every request starts with

    @property
    def prompt_tokens(self) -> int:
        return self.shared_tokens + self.own_tokens

    def prompts(self, words: list[str], seed: int) -> list[str]:
        gen = WordPrompts(words, seed)
        shared = gen.text(self.shared_tokens)
        return [shared + gen.text(self.own_tokens) for _ in range(self.requests)]

    def scaled(self, requests: int | None, output_tokens: int | None) -> "Workload":
        n = requests or self.requests
        return Workload(self.name, min(self.concurrency, n), n, self.own_tokens, output_tokens or self.output_tokens,
                        self.shared_tokens)


WORKLOADS = {
    "single": Workload("single", 1, 8, 128, 128),
    "batch64": Workload("batch64", 64, 64, 256, 64),
    "shared32": Workload("shared32", 32, 32, 32, 32, shared_tokens=512),
}


@dataclass
class Measurement:
    gguf: str
    server: str
    workload: str
    round: int
    start_s: float
    wall_s: float
    output_tokens: int
    output_tok_s: float
    median_tpot_ms: float | None
    median_ttft_ms: float | None
    prompt_tokens: tuple[int, int] | None   # (min, max) usage.prompt_tokens over the requests
    errors: list[str]
    memory: Memory
    reported_weights_bytes: dict[str, int]


def measure(server: RunningServer, gguf: Path, workload: Workload, words: list[str], rnd: int, seed: int) -> Measurement:
    asyncio.run(run_load(server.url, MODEL_NAME, [WordPrompts(words, seed - 1).text(16)], 4, 1))  # warm-up
    r: LoadResult = asyncio.run(run_load(server.url, MODEL_NAME, workload.prompts(words, seed),
                                         workload.output_tokens, workload.concurrency))
    ms = lambda s: None if s is None else round(s * 1000, 2)  # noqa: E731
    return Measurement(gguf.name, server.spec.kind, workload.name, rnd, round(server.start_s, 2), round(r.wall_s, 3),
                       r.output_tokens, round(r.output_tok_s, 2), ms(r.median_tpot_s), ms(r.median_ttft_s),
                       r.prompt_token_range, r.errors[:5], server.memory(), server.reported_weights_bytes())


def start(kind: str, gguf: Path, workload: Workload, args: argparse.Namespace, log_dir: Path, rnd: int) -> RunningServer:
    if kind == "flowrt":
        spec = flowrt_spec(gguf, shlex.split(args.flowrt_args))
    else:
        per_slot = workload.prompt_tokens + workload.output_tokens + 32   # + BOS, warm-up and slack
        context = -(-workload.concurrency * per_slot // 256) * 256
        spec = llamacpp_spec(gguf, args.llamacpp, args.threads, workload.concurrency, context,
                             shlex.split(args.llamacpp_args))
    return RunningServer(spec, log_dir / f"{gguf.stem}-{kind}-{workload.name}-r{rnd}.log")


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def print_line(m: Measurement) -> None:
    tpot = f" TPOT {m.median_tpot_ms:.1f} ms" if m.median_tpot_ms is not None else ""
    weights = ", ".join(f"{k} {mib(v)} MiB" for k, v in m.reported_weights_bytes.items()) or "none reported"
    print(f"  {m.server:9} {m.workload:8} round {m.round}: {m.output_tok_s:8.1f} out tok/s{tpot} | wall {m.wall_s:.1f} s"
          f" | prompt tokens {m.prompt_tokens} | VmRSS {mib(m.memory.vm_rss)} MiB RssAnon {mib(m.memory.rss_anon)}"
          f" RssFile {mib(m.memory.rss_file)} | weights: {weights} | start {m.start_s:.1f} s"
          + (f" | {len(m.errors)} errors: {m.errors[0]}" if m.errors else ""), flush=True)


def _median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def print_tables(ms: list[Measurement], servers: list[str], file_tensors: dict[str, int]) -> None:
    keys = list(dict.fromkeys((m.gguf, m.workload) for m in ms))
    print("\n| file | workload | " + " | ".join(f"{s} out tok/s (TPOT ms)" for s in servers)
          + (" | flowrt / llama.cpp |" if len(servers) == 2 else " |"))
    print("|---" * (2 + len(servers) + (len(servers) == 2)) + "|")
    for gguf, wl in keys:
        cells, rates = [], {}
        for s in servers:
            sel = [m for m in ms if (m.gguf, m.workload, m.server) == (gguf, wl, s)]
            rate, tpot = _median([m.output_tok_s for m in sel]), _median([m.median_tpot_ms for m in sel])
            rates[s] = rate
            cells.append("-" if rate is None else f"{rate:.1f}" + (f" ({tpot:.1f})" if wl == "single" and tpot else ""))
        ratio = ""
        if len(servers) == 2:
            a, b = rates[servers[0]], rates[servers[1]]
            ratio = f" | {a / b:.2f}x" if a and b else " | -"
        print(f"| {gguf} | {wl} | " + " | ".join(cells) + ratio + " |")
    print("\n| file (tensor MiB) | server | after workload | VmRSS MiB | RssAnon MiB | RssFile MiB | reported weights MiB |")
    print("|---|---|---|---|---|---|---|")
    last = {(m.gguf, m.server, m.workload): m for m in ms}   # the last round's
    for (gguf, server, wl), m in last.items():
        rep = " + ".join(f"{mib(v)} ({k})" for k, v in m.reported_weights_bytes.items()) or "-"
        print(f"| {gguf} ({mib(file_tensors[gguf])}) | {server} | {wl} | {mib(m.memory.vm_rss)} | {mib(m.memory.rss_anon)} | "
              f"{mib(m.memory.rss_file)} | {rep} |")


def tensor_bytes(gguf: Path) -> int:
    """The file's tensor data: what a server that keeps the file's formats needs for weights."""
    from flowrt.engine.model.gguf_loader import read_gguf_header

    return sum(t.nbytes for t in read_gguf_header(gguf).tensors.values())


def default_gguf() -> list[Path]:
    from flowrt.engine import default_model_path

    return [Path(default_model_path())]


def flowrt_dtype(flowrt_args: str) -> str:
    a = shlex.split(flowrt_args)
    return a[a.index("--dtype") + 1] if "--dtype" in a[:-1] else "auto"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, action="extend", nargs="+", default=None, metavar="PATH",
                   help="GGUF file(s) both servers load (repeatable; default: the shipped SmolLM2-135M Q4_1)")
    p.add_argument("--llamacpp", type=Path, default=Path("/tmp/llamacpp/bin"), metavar="DIR",
                   help="directory with llama-server (default /tmp/llamacpp/bin)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of: " + ", ".join(WORKLOADS))
    p.add_argument("--servers", default=",".join(SERVERS), help="comma-separated, of: " + ", ".join(SERVERS))
    p.add_argument("--rounds", type=int, default=1, help="repeat everything; the server order alternates")
    p.add_argument("--requests", type=int, default=None, help="requests per workload (and at most as many at once)")
    p.add_argument("--output-tokens", type=int, default=None, help="output length of every request")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t and -tb (default 2)")
    p.add_argument("--flowrt-args", default="", help='extra `flowrt serve` flags, e.g. "--quantization auto"')
    p.add_argument("--llamacpp-args", default="", help='extra llama-server flags, e.g. "-kvu"')
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--logs", type=Path, default=None, help="keep the server logs here (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None, help="also write every measurement as JSON")
    a = p.parse_args(argv)
    workloads = [WORKLOADS[w].scaled(a.requests, a.output_tokens) for w in a.workloads.split(",")]
    servers = [s for s in SERVERS if s in a.servers.split(",")]
    ggufs = a.gguf or default_gguf()
    from sysinfo import banner

    print(banner(flowrt_dtype(a.flowrt_args), f"llama-server -t {a.threads} -tb {a.threads} | flowrt args: "
                 f"{a.flowrt_args or '(none)'} | llama.cpp args: {a.llamacpp_args or '(none)'}"), flush=True)
    log_dir = a.logs or Path(tempfile.mkdtemp(prefix="bench-llamacpp-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"# server logs in {log_dir}", flush=True)
    ms: list[Measurement] = []
    file_tensors = {g.name: tensor_bytes(g) for g in ggufs}
    for gguf in ggufs:
        words = vocabulary_words(gguf)
        print(f"\n{gguf}: {gguf.stat().st_size / 2**20:,.1f} MiB, tensors {mib(file_tensors[gguf.name])} MiB", flush=True)
        for rnd in range(a.rounds):
            for kind in (servers if rnd % 2 == 0 else servers[::-1]):
                for i, wl in enumerate(workloads):
                    with start(kind, gguf, wl, a, log_dir, rnd) as server:
                        m = measure(server, gguf, wl, words, rnd, a.seed + 1000 * i)
                    ms.append(m)
                    print_line(m)
    print_tables(ms, servers, file_tensors)
    if a.json:
        from sysinfo import system_info

        a.json.write_text(json.dumps({"system": system_info(flowrt_dtype(a.flowrt_args)),
                                      "workloads": [asdict(w) for w in workloads], "file_tensor_bytes": file_tensors,
                                      "measurements": [asdict(m) for m in ms]}, indent=1))
    return 1 if any(m.errors for m in ms) else 0


if __name__ == "__main__":
    sys.exit(main())
