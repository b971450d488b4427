"""Test helpers for quantized weights: prompt log-probabilities and perplexity through the engine, greedy agreement.

    lps = prompt_logprobs(llm, text)     # log p(token i | tokens < i) for every prompt token after the first
    perplexity(llm, text)                # exp(-mean(lps))
    agree(greedy(a, prompts, 30), greedy(b, prompts, 30))   # how many greedy continuations are the same
    flips(a, b, prompts, 40)             # per prompt: None where a's greedy tokens are b's, else the gap (nats)
                                         # between b's choice and a's at the first token where they differ
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

from flowrt.engine import LLM, SamplingParams
from flowrt.engine.model.gguf_loader import read_gguf_header

PROMPTS = ["Once upon a time", "The little girl", "One day, a dog", "Tom and Sam went", "The sun was"]


def prompt_logprobs(llm: LLM, text: str | list[int], max_tokens: int | None = None) -> list[float]:
    """The log-probability the model gives each prompt token after the first (the prompt tokenized as the engine
    does; ``max_tokens``: only the first that many tokens). Prefix caching does not shorten it: a fresh request
    scores every prompt token."""
    ids = llm.tokenizer.encode(text) if isinstance(text, str) else list(text)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))[0]
    assert len(out.prompt_logprobs) == len(ids) - 1
    return [entry[tok].logprob for entry, tok in zip(out.prompt_logprobs, ids[1:])]


def perplexity(llm: LLM, text: str | list[int], max_tokens: int | None = None) -> float:
    lps = prompt_logprobs(llm, text, max_tokens)
    return math.exp(-sum(lps) / len(lps))


def greedy(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def agree(a: list[list[int]], b: list[list[int]]) -> int:
    """How many of the continuations are identical."""
    return sum(x == y for x, y in zip(a, b))


def flips(a: LLM, b: LLM, prompts: list[str], max_tokens: int) -> list[float | None]:
    """Where ``a``'s greedy continuation leaves ``b``'s: per prompt None (identical), else how much more likely ``b``
    found its own token than ``a``'s at the first difference. A near-tie (a few hundredths of a nat) is what rounding
    may flip; a bug shows as gaps of nats."""
    mine = greedy(a, prompts, max_tokens)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=20)
    out = []
    for tokens, theirs in zip(mine, b.generate(prompts, params)):
        ref = list(theirs.outputs[0].token_ids)
        i = next((i for i, (x, y) in enumerate(zip(tokens, ref)) if x != y), None)
        if i is None:
            out.append(None)
            continue
        lps = theirs.outputs[0].logprobs[i]
        out.append(lps[ref[i]].logprob - (lps[tokens[i]].logprob if tokens[i] in lps else -math.inf))
    return out


def tensor_bytes(path: str | Path) -> int:
    """Bytes of all tensor data in a GGUF file (what its weights take as stored)."""
    return sum(t.nbytes for t in read_gguf_header(path).tensors.values())


def set_tensor_type(path: str | Path, tensor: str, ggml_type: int) -> None:
    """Overwrite the type id of ``tensor`` in a GGUF file's tensor table (for tests of types no writer knows)."""
    data = bytearray(Path(path).read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name)  # the tensor-info entry: name, n_dims, dims, type, offset
    pos = at + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, pos)
    struct.pack_into("<I", data, pos + 4 + 8 * n_dims, ggml_type)
    Path(path).write_bytes(bytes(data))
