"""Rendering engine outputs in OpenAI's shapes: text deltas for streams, logprobs, usage.

Shared by completions and chat, streaming and not, so both endpoints report tokens the same way.
"""

from __future__ import annotations

import math
from typing import Any

from . import protocol as P
from .generation import Job


def clean_logprob(x: float | None) -> float:
    return -9999.0 if (x is None or math.isinf(x) or math.isnan(x)) else float(x)


PIECE_WINDOW = 6


class TokenText:
    """The text each token adds in context, for logprobs: decoding a token alone loses what depends on
    its neighbours (SentencePiece's leading space), so a token's text is decode(context + [token]) minus
    decode(context), over a short window of the tokens before it. Alternatives (top logprobs) are
    decoded in the same context. Special tokens are shown (e.g. "</s>")."""

    def __init__(self, tokenizer: Any, context: list[int]) -> None:
        self.tok = tokenizer
        self.ctx = list(context[-PIECE_WINDOW:])
        self._base: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def piece(self, tid: int) -> str:
        if not self.ctx:
            return self._decode([tid])
        if self._base is None:
            self._base = self._decode(self.ctx)
        full = self._decode(self.ctx + [tid])
        return full[len(self._base):] if full.startswith(self._base) else self._decode([tid])

    def advance(self, tid: int) -> None:
        self.ctx = (self.ctx + [tid])[-PIECE_WINDOW:]
        self._base = None


def _top_entries(lp_dict: dict[int, Any], k: int) -> list[tuple[int, Any]]:
    return sorted(((t, e) for t, e in lp_dict.items() if e.rank is not None and 1 <= e.rank <= k),
                  key=lambda te: te[1].rank)


class CompletionLogprobs:
    """Accumulates the legacy completions `logprobs` object (tokens, token_logprobs, top_logprobs,
    text_offset); the decoding context and `offset` continue across streamed chunks."""

    def __init__(self, tokenizer: Any, k: int, context: list[int]) -> None:
        self.text = TokenText(tokenizer, context)
        self.k = k
        self.offset = 0

    def build(self, token_ids: list[int], lps: list[dict[int, Any] | None]) -> dict[str, Any]:
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for tid, d in zip(token_ids, lps):
            s = self.text.piece(tid)
            tokens.append(s)
            offsets.append(self.offset)
            self.offset += len(s)
            if d is None:
                values.append(None)
                tops.append(None)
            else:
                entry = d.get(tid)
                values.append(clean_logprob(entry.logprob) if entry is not None else None)
                top = {self.text.piece(t): clean_logprob(e.logprob) for t, e in _top_entries(d, self.k)}
                if entry is not None:
                    top.setdefault(s, clean_logprob(entry.logprob))
                tops.append(top)
            self.text.advance(tid)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


class ChatLogprobs:
    """Chat `logprobs.content` entries; the decoding context continues across streamed chunks."""

    def __init__(self, tokenizer: Any, k: int, context: list[int]) -> None:
        self.text = TokenText(tokenizer, context)
        self.k = k

    def build(self, token_ids: list[int], lps: list[dict[int, Any]]) -> list[dict[str, Any]]:
        content = []
        for tid, d in zip(token_ids, lps):
            s = self.text.piece(tid)
            entry = (d or {}).get(tid)
            tops = []
            for t, e in _top_entries(d or {}, self.k):
                ts = self.text.piece(t)
                tops.append({"token": ts, "logprob": clean_logprob(e.logprob), "bytes": list(ts.encode("utf-8"))})
            content.append({"token": s, "logprob": clean_logprob(entry.logprob if entry is not None else None),
                            "bytes": list(s.encode("utf-8")), "top_logprobs": tops})
            self.text.advance(tid)
        return content


class Delta:
    """Turns cumulative per-choice snapshots into increments. While a choice is running it holds back
    text that could still change: a trailing incomplete UTF-8 character and, when stop strings are
    set, the last (longest stop string - 1) characters, which the engine may still remove."""

    def __init__(self, holdback: int) -> None:
        self.holdback = holdback
        self.text_sent: dict[int, int] = {}
        self.tokens_sent: dict[int, int] = {}
        self.done: set[int] = set()

    def text(self, ci: int, text: str, finished: bool) -> str:
        sent = self.text_sent.get(ci, 0)
        end = len(text)
        if not finished:
            end -= self.holdback
            while end > sent and text[end - 1] == "\ufffd":
                end -= 1
        if end <= sent:
            return ""
        self.text_sent[ci] = end
        return text[sent:end]

    def tokens(self, ci: int, o: Any) -> tuple[list[int], list[Any]]:
        sent = self.tokens_sent.get(ci, 0)
        if o.logprobs is None:
            return [], []
        end = min(len(o.token_ids), len(o.logprobs))
        self.tokens_sent[ci] = max(sent, end)
        return list(o.token_ids[sent:end]), list(o.logprobs[sent:end])


def usage_of(finals: dict[int, Any], jobs: list[Job]) -> dict[str, Any]:
    prompt = completion = cached = 0
    for job in jobs:
        out = finals.get(job.index)
        prompt += len(job.prompt_ids)
        if out is not None:
            completion += sum(len(o.token_ids) for o in out.outputs)
            cached += out.num_cached_tokens or 0
    return P.usage(prompt, completion, cached)


def stop_holdback(stop: str | list[str] | None) -> int:
    """Characters a stream holds back while running: the engine may still remove a stop string."""
    stops = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
    return max((len(s) for s in stops), default=1) - 1
