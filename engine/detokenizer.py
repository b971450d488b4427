"""Incremental detokenization: text grows token by token without re-decoding the whole output.

Decoding a window that starts a few tokens back (prefix) and comparing with the window's old text gives
the new characters; a window ending in an incomplete UTF-8 sequence (U+FFFD) waits for more tokens. The
window starts inside the prompt for the first output tokens, so leading-space handling of SentencePiece
decoders is the same as in the full text.
"""

from __future__ import annotations

from .sequence import Sequence

WINDOW = 5


def start(seq: Sequence) -> None:
    seq.text = ""
    seq.detok_read = seq.prompt_len
    seq.detok_prefix = max(0, seq.prompt_len - WINDOW)


def update(tokenizer, seq: Sequence, skip_special_tokens: bool) -> str:
    """Appends the text of newly generated tokens to seq.text and returns it (may be '')."""
    ids = seq.token_ids
    if seq.detok_read >= len(ids):
        return ""
    prefix_text = tokenizer.decode(ids[seq.detok_prefix : seq.detok_read], skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(ids[seq.detok_prefix :], skip_special_tokens=skip_special_tokens)
    if len(full) <= len(prefix_text) or full.endswith("\ufffd"):
        return ""
    delta = full[len(prefix_text) :]
    seq.text += delta
    seq.detok_prefix = max(seq.detok_read, len(ids) - WINDOW)
    seq.detok_read = len(ids)
    return delta
