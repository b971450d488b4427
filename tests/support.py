"""What tests share: paths, golden outputs and helpers (fixtures stay in conftest.py).

Test modules import it as `support` (pyproject sets pytest's pythonpath to tests/).
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
STORIES = TESTS / "models" / "stories260K"

# Greedy output of transformers on stories260K for "Once upon a time" (prompt ids [1, 403, 407, 261, 378]),
# 30 new tokens, float32 (models/stories260K/SOURCE.md).
STORIES_PROMPT = "Once upon a time"
STORIES_PROMPT_IDS = [1, 403, 407, 261, 378]
STORIES_GREEDY_30 = ", there was a little girl named Lily. She loved to play outside in the park. One day,"


def make_chat_model(out_dir: Path, chat_template: str, max_position_embeddings: int = 512) -> Path:
    """A tiny random Llama (hidden 32, 2 layers, seed 0) with stories260K's tokenizer and the given chat template:
    what the server's chat and tool tests serve."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(STORIES)
    tok.chat_template = chat_template
    tok.save_pretrained(out_dir)
    cfg = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out_dir)
    return out_dir


def make_tiny_model(out_dir: Path, arch: str = "llama", tie: bool = True, seed: int = 0, **overrides) -> str:
    """A random-weight model of the given architecture with stories260K's tokenizer (vocab 512).

    Norm weights and biases are randomized too, so every parameter path is exercised.
    """
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }
    cfg_cls, model_cls = classes[arch]
    kw = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=tie, bos_token_id=1,
        eos_token_id=2, rms_norm_eps=1e-5,
    )
    if arch == "qwen3":
        kw["head_dim"] = 16
    if arch == "mistral":
        kw["sliding_window"] = None
    kw.update(overrides)
    cfg = cfg_cls(**kw)
    torch.manual_seed(seed)
    model = model_cls(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0, 0.08)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(STORIES / f, out_dir / f)
    return str(out_dir)


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int, dtype=None) -> list[int]:
    """Reference: transformers' own model, greedy with its KV cache, never stopping early."""
    import torch

    model = _hf_model(model_dir, dtype)
    ids = torch.tensor([prompt_ids])
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):  # full recompute each step: no cache API differences across versions
            nxt = int(model(input_ids=ids).logits[0, -1].float().argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


_HF_CACHE: dict = {}


def _hf_model(model_dir, dtype):
    import torch
    from transformers import AutoModelForCausalLM

    key = (model_dir, dtype)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32).eval()
    return _HF_CACHE[key]


def serve_model(model_dir: str, engine_kwargs: dict | None = None, **app_kwargs):
    """Generator for server fixtures: an AsyncLLM on `model_dir` (with `engine_kwargs`) behind the app on a
    free loopback port; yields the BackgroundServer (with `.engine`), then stops both."""
    from flowrt.engine import AsyncLLM
    from flowrt.server.app import create_app
    from flowrt.server.background import BackgroundServer

    engine = AsyncLLM(model=str(model_dir), seed=0, dtype="float32", **(engine_kwargs or {}))
    srv = BackgroundServer(create_app(engine, **app_kwargs)).start()
    srv.engine = engine
    try:
        yield srv
    finally:
        srv.stop()
        engine.shutdown()


def leak_checked_model(engine):
    """Fixture body: an fr.Model on `engine`; afterwards no sequence is open and no block is held (every block
    free or only in the prefix cache)."""
    import gc

    import flowrt as fr

    yield fr.Model(engine)
    st = engine.stats()
    if st["open_sequences"] or st["kv_blocks_used"]:
        # what only garbage collection releases (handles in reference cycles); a full collection of the test
        # session's heap takes seconds, so it runs only when something is still held
        gc.collect()
        st = engine.stats()
    assert st["open_sequences"] == 0, st
    assert st["kv_blocks_used"] == 0, st


def retrieval_cli(*argv) -> int:
    """`flowrt index ...` / `flowrt query ...` in this process (the retrieval subcommands' parser alone)."""
    import argparse

    from flowrt.retrieval.cli import add_parser

    parser = argparse.ArgumentParser(prog="flowrt")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args([str(a) for a in argv])
    return args.func(args)


def flowrt_cli(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    """``python -m flowrt.cli ARGS`` as a child process in the repository root, ``env`` added to this process's
    environment, stdout and stderr as text pipes (``kw``: more ``Popen`` arguments)."""
    return subprocess.Popen([sys.executable, "-m", "flowrt.cli", *args], cwd=ROOT, env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def load_workflow_source(tmp_path: Path, name: str, source: str, calls_of: str):
    """Writes a workflow file's ``source`` to ``tmp_path / name`` and loads its ``wf``. Returns the file's path, the
    workflow and the file's ``CALLS`` list (found through step ``calls_of``'s globals)."""
    from flowrt.graph.loader import load_workflow

    f = tmp_path / name
    f.write_text(source)
    wf = load_workflow(str(f))
    return str(f), wf, wf.steps[calls_of].fn.__globals__["CALLS"]


# Source for workflow files that tests run as child processes and kill mid-step (the file imports os, pathlib and
# time): maybe_hang(name) writes name to $FLOWRT_TEST_READY and sleeps when $FLOWRT_TEST_HANG is name.
MAYBE_HANG = '''
def maybe_hang(name):
    if os.environ.get("FLOWRT_TEST_HANG") == name:
        pathlib.Path(os.environ["FLOWRT_TEST_READY"]).write_text(name)
        time.sleep(600)
'''


def kill_at(step: str, ready: Path, *args: str, env: dict | None = None, until=None) -> None:
    """Runs ``flowrt ARGS`` (``flowrt_cli``) on a workflow file with ``MAYBE_HANG`` until it hangs in step
    ``step`` (it writes the file ``ready`` there) and ``until()`` (when given) is true, then kills it with
    SIGKILL."""
    p = flowrt_cli(*args, env={**(env or {}), "FLOWRT_TEST_HANG": step, "FLOWRT_TEST_READY": str(ready)})
    deadline = time.time() + 300
    while not ready.exists() or (until is not None and not until()):
        assert p.poll() is None, p.communicate()
        assert time.time() < deadline
        time.sleep(0.1)
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=30)
