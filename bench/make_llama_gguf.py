#!/usr/bin/env python
"""Write a random-weight Llama of a chosen shape as an F16 (or F32) GGUF, for benchmarks at sizes no shipped
model has.

    python bench/make_llama_gguf.py /tmp/quant1b/llama1b-f16.gguf            # the 1B shape below
    /tmp/llamacpp/bin/llama-quantize /tmp/quant1b/llama1b-f16.gguf /tmp/quant1b/llama1b-q4_k_m.gguf Q4_K_M

The default shape is Llama-3.2-1B's (hidden 2048, 16 layers, 32 heads of 64, 8 KV heads, intermediate 8192),
with tied embeddings as that model has (``--untied`` adds an output.weight). The vocabulary and every
``tokenizer.*`` key are copied from a tokenizer GGUF (default: the shipped SmolLM2-135M-Instruct file, vocab
49,152), so flowrt and llama.cpp tokenize prompts exactly as they do for that model. Speed does not depend on
the weight values; they are normal * 0.02 (norms 1), which keeps logits finite and small.

Tensors are generated and written one at a time, so memory stays near the largest tensor (the embedding).
Only the gguf package is needed: the file is a benchmark input, not something flowrt's engine imports.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np


@dataclass(frozen=True)
class LlamaShape:
    hidden: int = 2048
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    intermediate: int = 8192
    tied: bool = True
    rope_theta: float = 500000.0
    context: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def default_tokenizer_gguf() -> Path:
    from flowrt.engine import default_model_path

    return Path(default_model_path())


def tensor_shapes(s: LlamaShape, vocab: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """GGUF tensor names in llama.cpp's order, with numpy (rows, cols) shapes."""
    kv = s.kv_heads * s.head_dim
    yield "token_embd.weight", (vocab, s.hidden)
    for i in range(s.layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (s.hidden,)
        yield b + "attn_q.weight", (s.hidden, s.hidden)
        yield b + "attn_k.weight", (kv, s.hidden)
        yield b + "attn_v.weight", (kv, s.hidden)
        yield b + "attn_output.weight", (s.hidden, s.hidden)
        yield b + "ffn_norm.weight", (s.hidden,)
        yield b + "ffn_gate.weight", (s.intermediate, s.hidden)
        yield b + "ffn_up.weight", (s.intermediate, s.hidden)
        yield b + "ffn_down.weight", (s.hidden, s.intermediate)
    yield "output_norm.weight", (s.hidden,)
    if not s.tied:
        yield "output.weight", (vocab, s.hidden)


def copy_tokenizer(writer, tokenizer_gguf: Path) -> int:
    """Copies every tokenizer.* key; returns the vocabulary size."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(tokenizer_gguf))
    vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        value = field.contents()
        writer.add_key_value(name, value, vtype, sub_type=sub)
        if name == "tokenizer.ggml.tokens":
            vocab = len(value)
    if not vocab:
        raise ValueError(f"{tokenizer_gguf} has no tokenizer.ggml.tokens")
    return vocab


def write_llama_gguf(out: Path, shape: LlamaShape, tokenizer_gguf: Path, dtype=np.float16, seed: int = 0) -> Path:
    import gguf

    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(f"random llama h{shape.hidden} l{shape.layers}")
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(1 if dtype == np.float16 else 0)
    vocab = copy_tokenizer(w, tokenizer_gguf)
    w.add_vocab_size(vocab)

    shapes = list(tensor_shapes(shape, vocab))
    for name, shp in shapes:
        t = dtype if len(shp) == 2 else np.float32  # norms stay F32, as llama.cpp keeps them
        w.add_tensor_info(name, shp, np.dtype(t), int(np.prod(shp)) * np.dtype(t).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _name, shp in shapes:
        if len(shp) == 1:
            w.write_tensor_data(np.ones(shp, np.float32))
        else:
            a = rng.standard_normal(shp, dtype=np.float32)
            a *= 0.02
            w.write_tensor_data(a.astype(dtype))
            del a
    w.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    d = LlamaShape()
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--kv-heads", type=int, default=d.kv_heads)
    p.add_argument("--intermediate", type=int, default=d.intermediate)
    p.add_argument("--untied", action="store_true", help="write a separate output.weight (default: tied)")
    p.add_argument("--f32", action="store_true", help="F32 weights (default F16)")
    p.add_argument("--tokenizer-gguf", type=Path, default=None,
                   help="GGUF whose tokenizer is copied (default: the shipped SmolLM2-135M-Instruct)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    shape = LlamaShape(a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate, tied=not a.untied)
    out = write_llama_gguf(a.out, shape, a.tokenizer_gguf or default_tokenizer_gguf(),
                           np.float32 if a.f32 else np.float16, a.seed)
    print(f"wrote {out} ({out.stat().st_size / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
