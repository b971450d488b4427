"""Prefix-friendly RAG prompts.

The engine caches KV per 16-token block of prompt prefix. Two prompts share cached blocks only up to
their first difference, so the context is rendered

* in a stable order, by (source, position), never by score: two queries that retrieve the same or
  overlapping chunks then put the common chunks at the same place, and a chunk's text never moves
  because a different query ranked it differently;
* with byte-stable chunk blocks: a chunk renders the same way whatever the query (no score, no rank
  number), with its source as the label that answers cite;
* instructions first, question last: everything query-specific comes after the shared part.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

from .chunking import Chunk

__all__ = ["rag", "order_chunks", "DEFAULT_TEMPLATE", "DEFAULT_CHUNK_TEMPLATE", "render_chunk"]

DEFAULT_TEMPLATE = (
    "Answer the question using only the sources below. After each fact, cite its source in square "
    "brackets, like [install.md]. If the sources do not contain the answer, say so.\n\n"
    "{context}\n\n"
    "Question: {question}\n"
    "Answer:"
)
DEFAULT_CHUNK_TEMPLATE = "[{source}] {heading}\n{text}"
_SEPARATOR = "\n\n"


def _get(c: Any, name: str, default: Any = None) -> Any:
    if isinstance(c, Mapping):
        return c.get(name, default)
    return getattr(c, name, default)


def _key(c: Any) -> tuple:
    return (str(_get(c, "source", "")), int(_get(c, "position", 0) or 0), int(_get(c, "start", 0) or 0))


def order_chunks(chunks: Iterable[Chunk | Mapping[str, Any]], order: str = "stable") -> list:
    """Chunks in prompt order, duplicates (same source and position) removed.

    ``order="stable"``: by source, then position (the default: shares prompt prefixes between queries).
    ``order="score"``: as given (search results come best first); only for comparison.
    """
    seen: set[tuple] = set()
    out = []
    for c in chunks:
        k = _key(c)
        if k in seen:
            continue
        seen.add(k)
        out.append(c)
    if order == "stable":
        out.sort(key=_key)
    elif order != "score":
        raise ValueError(f"order must be 'stable' or 'score', got {order!r}")
    return out


def render_chunk(c: Chunk | Mapping[str, Any], chunk_template: str = DEFAULT_CHUNK_TEMPLATE) -> str:
    return chunk_template.format(
        source=_get(c, "source", ""),
        heading=_get(c, "heading", "") or _get(c, "title", "") or "",
        title=_get(c, "title", "") or "",
        position=_get(c, "position", 0),
        text=str(_get(c, "text", "")).strip(),
    )


def rag(
    chunks: Sequence[Chunk | Mapping[str, Any]],
    question: str | None = None,
    template: str = DEFAULT_TEMPLATE,
    *,
    chunk_template: str = DEFAULT_CHUNK_TEMPLATE,
    order: str = "stable",
    max_tokens: int | None = None,
    count_tokens: Callable[[str], int] | None = None,
) -> str:
    """Render retrieved chunks (and the question) into a prompt whose prefix other queries can share.

    ``template`` has ``{context}`` and ``{question}`` placeholders. With ``question=None`` the result is
    the template up to and including the context, so the caller can append the question itself.

    ``max_tokens`` (with ``count_tokens``, e.g. ``lambda s: len(tokenizer.encode(s))``) bounds the prompt:
    the lowest-scored chunks are dropped until it fits (survivors keep their stable order); if even one
    chunk does not fit, its text is cut. Chunks may be :class:`Chunk` objects or dicts with the same keys.
    """
    if "{context}" not in template:
        raise ValueError("template must contain a {context} placeholder")
    if question is not None and "{question}" not in template:
        raise ValueError("template must contain a {question} placeholder when a question is given")
    items = list(chunks)

    def render(cs: Sequence) -> str:
        context = _SEPARATOR.join(render_chunk(c, chunk_template) for c in order_chunks(cs, order))
        if question is None:
            head = template.split("{context}", 1)[0]
            return head.format(question="") + context
        return template.replace("{context}", "\0CTX\0").format(question=question).replace("\0CTX\0", context)

    text = render(items)
    if max_tokens is None:
        return text
    if count_tokens is None:
        raise ValueError("max_tokens needs count_tokens (a function giving a string's token count)")
    if count_tokens(text) <= max_tokens:
        return text
    # Drop the weakest chunks first (by score when known, else the last ones given).
    ranked = sorted(range(len(items)), key=lambda i: (-(_get(items[i], "score") or 0.0), i))
    keep = list(ranked)
    while len(keep) > 1:
        keep.pop()
        text = render([items[i] for i in sorted(keep)])
        if count_tokens(text) <= max_tokens:
            return text
    # One chunk left and still too long: cut its text (binary search on characters).
    if not keep:
        return text
    c = items[keep[0]]
    body = str(_get(c, "text", ""))
    lo, hi = 0, len(body)
    best = render([_with_text(c, "")])
    while lo < hi:
        mid = (lo + hi + 1) // 2
        cand = render([_with_text(c, body[:mid])])
        if count_tokens(cand) <= max_tokens:
            lo, best = mid, cand
        else:
            hi = mid - 1
    return best


def _with_text(c: Any, text: str) -> dict[str, Any]:
    d = dict(c) if isinstance(c, Mapping) else (c.to_dict() if hasattr(c, "to_dict") else dict(vars(c)))
    d["text"] = text
    return d
