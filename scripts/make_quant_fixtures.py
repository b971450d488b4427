#!/usr/bin/env python
"""Regenerate tests/models/quant/: one tiny random Llama in every GGUF weight type, each made by llama.cpp's
own ``llama-quantize`` (so the files hold llama.cpp's bits, not the gguf package's).

    python scripts/make_quant_fixtures.py /tmp/llamacpp/bin/llama-quantize [--out tests/models/quant]

Run by hand (it needs a llama.cpp build, see ../shared/peers/build_llamacpp.sh), never by CI. It writes the
F32 source with tests/gguf_util.py (llama.cpp's tensor layout, stories260K's tokenizer), quantizes it with
``--allow-requantize --pure`` into each type of TYPES (every 2-D tensor that type, as far as llama-quantize
allows) and without ``--pure`` into the Q4_K_M mixture, then writes manifest.json (sha256 and the tensor types
read back from each file; tests/engine/test_quant_fixtures.py checks them) and README.md from it.

The shape is the smallest a K-quant accepts everywhere (every row a multiple of 256 elements) that keeps the
whole set near 6 MB: hidden 256, one layer, 4 heads of 64, 2 KV heads, intermediate 256, vocab 512, tied
embeddings. Weights are normal with std 1/sqrt(fan_in), o_proj and down_proj 2/sqrt(fan_in), embeddings 0.2: with
larger embeddings a tied one-layer model only repeats its last token (its own row dominates the logits), with
smaller ones the top two logits come within a hair of each other; this mix varies its greedy output and keeps
top-1 margins mostly 0.1-6 nats.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

LLAMA_CPP_TAG = "b11434"
PURE_TYPES = ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
              "IQ4_NL")
MIXED_TYPES = ("Q4_K_M",)
SEED = 0


@dataclass(frozen=True)
class Fixture:
    """One generated file, as manifest.json records it."""
    file: str
    ftype: str          # the llama-quantize type argument
    pure: bool
    sha256: str
    bytes: int
    tensor_types: dict[str, str]  # GGUF tensor name -> ggml type name, as read back


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1,
                       eos_token_id=2)


def random_state(config, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Hugging Face names -> float32 weights; explicit draws, so the bits depend on torch's generator only."""
    g = torch.Generator().manual_seed(seed)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d

    def w(rows, cols, gain=1.0):
        return torch.randn(rows, cols, generator=g) * (gain / cols ** 0.5)

    state = {"model.embed_tokens.weight": 0.2 * torch.randn(config.vocab_size, h, generator=g)}
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        state.update({
            p + "input_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
            p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q, 2.0),
            p + "post_attention_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
            p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
            p + "mlp.down_proj.weight": w(h, i, 2.0),
        })
    state["model.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    return state


def tensor_types(path: Path) -> dict[str, str]:
    from flowrt.engine.model.gguf_loader import read_gguf_header

    return {name: t.type_name for name, t in read_gguf_header(path).tensors.items()}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def quantize(llama_quantize: Path, src: Path, out: Path, ftype: str, pure: bool) -> None:
    cmd = [str(llama_quantize), "--allow-requantize", *(["--pure"] if pure else []), str(src), str(out), ftype]
    r = subprocess.run(cmd, capture_output=True, text=True, errors="replace")  # it logs raw vocab bytes
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")


def make_fixtures(llama_quantize: Path, out_dir: Path) -> list[Fixture]:
    from gguf_util import STORIES_DIR, write_gguf

    out_dir.mkdir(parents=True, exist_ok=True)
    config = tiny_config()
    fixtures = []
    with tempfile.TemporaryDirectory() as tmp:
        src = write_gguf(random_state(config), Path(tmp) / "tiny-f32.gguf", "F32", config=config,
                         tokenizer=STORIES_DIR, name="tiny random llama (quant fixtures)")
        for ftype, pure in [(t, True) for t in PURE_TYPES] + [(t, False) for t in MIXED_TYPES]:
            out = out_dir / f"tiny-{ftype.lower()}.gguf"
            quantize(llama_quantize, src, out, ftype, pure)
            fixtures.append(Fixture(out.name, ftype, pure, sha256(out), out.stat().st_size, tensor_types(out)))
            print(f"{out.name}: {out.stat().st_size} bytes", flush=True)
    return fixtures


def _types_summary(types: dict[str, str]) -> str:
    by_type: dict[str, list[str]] = {}
    for name, t in types.items():
        by_type.setdefault(t, []).append(name.removesuffix(".weight").removeprefix("blk.0."))
    return "; ".join(f"{t}: {', '.join(names)}" for t, names in sorted(by_type.items()))


def readme(fixtures: list[Fixture], command: str) -> str:
    rows = "\n".join(f"| {f.file} | {f.ftype}{' --pure' if f.pure else ''} | {f.bytes:,} | "
                     f"{_types_summary(f.tensor_types)} | `{f.sha256[:16]}` |" for f in fixtures)
    return f"""# GGUF weight-type fixtures

One tiny random-weight Llama (hidden 256, 1 layer, 4 heads of 64, 2 KV heads, intermediate 256, vocab 512 with
stories260K's tokenizer, tied embeddings) in every GGUF weight type, each file made by llama.cpp's
`llama-quantize` (tag {LLAMA_CPP_TAG}, built by ../shared/peers/build_llamacpp.sh) from one F32 GGUF written by
tests/gguf_util.py. Every row is a multiple of 256 elements, so K-quants apply to every 2-D tensor.

Regenerate (by hand, never in CI): `{command}`
(scripts/make_quant_fixtures.py; seed {SEED}; the F32 source is not kept). manifest.json holds the full
sha256 and every tensor's type; tests/engine/test_quant_fixtures.py checks the files against it.

Each pure file was made with `llama-quantize --allow-requantize --pure SRC OUT TYPE`, tiny-q4_k_m.gguf without
`--pure` (llama.cpp's own Q4_K_M mixture). Norms stay F32 in every file (llama.cpp quantizes only 2-D
tensors). The embeddings are tied (no output.weight): with `--pure` llama-quantize gave token_embd the file's
type like every other 2-D tensor; in the Q4_K_M mixture it made token_embd Q6_K, as it does for an output
tensor, and attn_v and ffn_down Q6_K (its "more bits" layers; with one layer, that layer). No type needed an
importance matrix. Tensor types as read back (`blk.0.` and `.weight` left off):

| file | llama-quantize type | bytes | tensor types | sha256 (first 16) |
|---|---|---|---|---|
{rows}

Random weights, so the text they generate means nothing; the files exist to test that every weight type
loads and computes what the file says.
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("llama_quantize", type=Path, help="path to llama.cpp's llama-quantize")
    p.add_argument("--out", type=Path, default=ROOT / "tests" / "models" / "quant")
    a = p.parse_args(argv)
    fixtures = make_fixtures(a.llama_quantize, a.out)
    (a.out / "manifest.json").write_text(json.dumps(
        {"llama_cpp_tag": LLAMA_CPP_TAG, "seed": SEED, "fixtures": [asdict(f) for f in fixtures]}, indent=1) + "\n")
    command = "python scripts/make_quant_fixtures.py /tmp/llamacpp/bin/llama-quantize"
    (a.out / "README.md").write_text(readme(fixtures, command))
    total = sum(f.bytes for f in fixtures)
    print(f"{len(fixtures)} files, {total / 2**20:.2f} MiB in {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
