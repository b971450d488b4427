"""Incremental detokenization: text grows token by token without re-decoding the whole output.

Decoding a window that starts a few tokens back (prefix) and comparing with the window's old text gives
the new characters; a window ending in an incomplete UTF-8 sequence (U+FFFD) waits for more tokens. The
window starts inside the prompt for the first output tokens, so leading-space handling of SentencePiece
decoders is the same as in the full text.

This module is the only writer of a sequence's `detok` part (engine/request/sequence.py's DetokState).
"""

from __future__ import annotations

from ..request.sequence import DetokState, Sequence

WINDOW = 5


def start(seq: Sequence) -> None:
    """seq's output starts after its prompt (sample.prompt_len tokens): no text yet."""
    n = seq.sample.prompt_len
    seq.detok = DetokState("", max(0, n - WINDOW), n)


def update(tokenizer, seq: Sequence, skip_special_tokens: bool) -> str:
    """Appends the text of newly generated tokens to seq.detok.text and returns it (may be '')."""
    ids = seq.token_ids
    d = seq.detok
    if d.read >= len(ids):
        return ""
    prefix_text = tokenizer.decode(ids[d.prefix : d.read], skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(ids[d.prefix :], skip_special_tokens=skip_special_tokens)
    if len(full) <= len(prefix_text) or full.endswith("\ufffd"):
        return ""
    delta = full[len(prefix_text) :]
    d.text += delta
    d.prefix = max(d.read, len(ids) - WINDOW)
    d.read = len(ids)
    return delta


def cut(seq: Sequence, num_chars: int) -> None:
    """The output's text ends after its first num_chars characters (a stop string)."""
    seq.detok.text = seq.detok.text[:num_chars]
