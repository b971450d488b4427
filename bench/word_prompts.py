"""Text prompts of an exact token count for any server that uses a GGUF file's own tokenizer.

Sending token ids would be exact too, but then neither server tokenizes; with text both do, as real clients
make them. The words are vocabulary entries that are one token with their leading space (``Ġword`` in a
byte-level BPE, ``▁word`` in a SentencePiece one): every pre-tokenizer splits " w1 w2 w3" at the spaces, so
N such words are N tokens on either server (plus a BOS where the file asks for one). The servers' reported
usage.prompt_tokens confirms it per request.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

_WORD = re.compile(r"^[\u0120\u2581]([a-z]{3,9})$")  # Ġ (byte-level space) or ▁ (SentencePiece space)


def vocabulary_words(gguf_path: Path) -> list[str]:
    from flowrt.engine.model.gguf_loader import read_gguf_header

    header = read_gguf_header(gguf_path, keep_string_arrays=("tokenizer.ggml.tokens",))
    tokens = header.metadata["tokenizer.ggml.tokens"]
    words = sorted({m.group(1) for t in tokens if (m := _WORD.match(t))})
    if len(words) < 100:
        raise ValueError(f"{gguf_path}: only {len(words)} single-token words in its vocabulary")
    return words


class WordPrompts:
    """Random word sequences; the same seed gives the same prompts whichever server they go to."""

    def __init__(self, words: list[str], seed: int):
        self.words = words
        self.rng = random.Random(seed)

    def text(self, n_tokens: int) -> str:
        return "".join(" " + self.rng.choice(self.words) for _ in range(n_tokens))
