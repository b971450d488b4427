"""Where n-grams last occurred: the lookups of speculative decoding's drafter (engine/decoding/spec_decode.py), kept up
to date as tokens append instead of scanning the whole context every step.

NgramIndex: for each n in n_min..n_max, the latest position that followed an n-gram of a token list (an n-gram counts
once a token follows it, so a list's own suffix never matches itself: the answer of a scan of the whole list, which
tests/engine/test_spec_drafter.py keeps as the reference). `extend` indexes only what was appended since the last
call; a list that no longer starts as the indexed one did (another sequence's, or one cut short) is indexed again
from scratch.

SuffixCache: the outputs of recently finished requests, indexed the same way (SuffixDecoding's idea, vLLM's `suffix`
method): agent and extraction workloads repeat their output structures (a JSON template, a reply's phrasing), which
the prompt need not contain. Bounded in tokens: past the bound the older half is forgotten.
"""

from __future__ import annotations

_SEP = -1  # between two outputs in the SuffixCache: no n-gram across it matches a real context


class NgramIndex:
    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.last: dict[tuple[int, ...], int] = {}  # n-gram -> the position right after its latest occurrence
        self._seen = 0  # tokens indexed
        self._ends: tuple[int, int] | None = None  # first and last indexed token (a cheap identity check)

    def extend(self, tokens: list[int]) -> None:
        """Index tokens[self._seen:] (all of `tokens` if they are not the indexed list grown)."""
        L = len(tokens)
        if self._ends is not None and (L < self._seen or (tokens[0], tokens[self._seen - 1]) != self._ends):
            self.last.clear()
            self._seen = 0
        last, lo, hi = self.last, self.n_min, self.n_max
        for i in range(max(self._seen, 1), L):  # i: a continuation's start; the n tokens before it, for each n
            for n in range(lo, min(hi, i) + 1):
                last[tuple(tokens[i - n:i])] = i
        self._seen = L
        if L:
            self._ends = (tokens[0], tokens[L - 1])

    def find(self, context: list[int], n_max: int, n_min: int) -> int | None:
        """Where the continuation of the latest earlier occurrence of the longest suffix of `context` (n_max down
        to n_min tokens, within the indexed range) starts in the indexed list; None if none occurred. `context`:
        the indexed list itself (prompt lookup), or another list (the suffix cache's lookups)."""
        last, L = self.last, len(context)
        for n in range(min(n_max, self.n_max, L), max(n_min, self.n_min) - 1, -1):
            s = last.get(tuple(context[L - n:]))
            if s is not None:
                return s
        return None


class SuffixCache:
    """Recent requests' outputs as one token list (outputs separated) with its NgramIndex."""

    def __init__(self, max_tokens: int, n_min: int, n_max: int):
        self.max_tokens = max_tokens
        self.tokens: list[int] = []
        self.index = NgramIndex(n_min, n_max)

    def add(self, output: list[int]) -> None:
        if not output:
            return
        output = output[-self.max_tokens // 2:]
        if len(self.tokens) + len(output) + 1 > self.max_tokens:  # forget the older half (whole outputs)
            cut = self.tokens.index(_SEP, len(self.tokens) // 2) + 1
            self.tokens = self.tokens[cut:]
            self.index = NgramIndex(self.index.n_min, self.index.n_max)
        self.tokens.extend(output)
        self.tokens.append(_SEP)
        self.index.extend(self.tokens)

    def draft(self, context: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest occurrence, in the outputs, of the longest suffix of `context`
        (prompt_lookup_max down to prompt_lookup_min tokens); [] if none."""
        s = self.index.find(context, self.index.n_max, self.index.n_min)
        if s is None:
            return []
        cont = self.tokens[s:s + k]
        return cont[:cont.index(_SEP)] if _SEP in cont else cont
