"""Token-based chunking that respects Markdown headings, paragraphs and sentences.

A document is split into sections at Markdown ATX headings (``#`` .. ``######``, never inside fenced
code). A chunk never spans two sections. Inside a section, chunks hold at most ``chunk_tokens`` tokens
(counted with the embedder's tokenizer) and end, in order of preference, at a paragraph break, at a
sentence break, or mid-sentence when a single sentence is longer than a chunk. Consecutive chunks of a
section overlap by up to ``overlap`` tokens, starting at a sentence boundary when one is near.

Every chunk keeps its source, its position in the document, the heading path above it
("Title > Section > Subsection") and its character span in the source text.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

__all__ = ["Chunk", "ChunkingConfig", "Chunker", "split_sections", "Document"]

TokenSpans = Callable[[str], Sequence[tuple[int, int]]]


@dataclass(frozen=True)
class Chunk:
    """A piece of a document, as stored in an index and returned by a search.

    ``score`` is the similarity to the query (cosine, higher is closer) on search results, else None.
    """

    text: str
    source: str
    position: int
    heading: str = ""
    title: str = ""
    start: int = 0  #: character offset of ``text`` in the source document
    end: int = 0
    id: int = -1  #: the chunk's id in its index
    score: float | None = None

    @property
    def doc_id(self) -> str:
        """Documents are identified by their source id (rules in flowrt.retrieval.sources)."""
        return self.source

    def with_score(self, score: float) -> "Chunk":
        return dataclasses.replace(self, score=float(score))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["score"] is None:
            del d["score"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Chunk":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class ChunkingConfig:
    chunk_tokens: int = 192
    overlap: int = 32

    def __post_init__(self):
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 8:
            raise ValueError(f"chunk_tokens must be an integer >= 8, got {self.chunk_tokens!r}")
        if not isinstance(self.overlap, int) or self.overlap < 0 or self.overlap >= self.chunk_tokens // 2 + 1:
            raise ValueError(
                f"overlap must be an integer in [0, chunk_tokens/2] ({self.chunk_tokens // 2}), got {self.overlap!r}"
            )

    def to_dict(self) -> dict[str, int]:
        return {"chunk_tokens": self.chunk_tokens, "overlap": self.overlap}


@dataclass
class Document:
    source: str  #: the document's source id: its key in an index (see flowrt.retrieval.sources)
    text: str
    path: Path | None = None  #: the file it was read from (its origin), if any
    meta: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------- Markdown sections

_HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?[ \t]*#*[ \t]*$")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_FRONT_MATTER = re.compile(r"\A---[ \t]*\n.*?\n(?:---|\.\.\.)[ \t]*(?:\n|\Z)", re.S)


@dataclass(frozen=True)
class Section:
    heading: str  #: "Title > Section > Subsection" ("" before the first heading of a plain file)
    start: int  #: body span (heading line excluded) in the document text
    end: int


def split_sections(
    text: str, *, markdown: bool = True, title: str = ""
) -> tuple[str, list[Section], list[tuple[int, int]]]:
    """Split a document into heading sections.

    Returns (title, sections, fenced code spans). The title is the first level-1 heading, else ``title``.
    """
    fm = _FRONT_MATTER.match(text) if markdown else None
    pos = fm.end() if fm else 0
    sections: list[Section] = []
    fences: list[tuple[int, int]] = []
    stack: list[tuple[int, str]] = []
    doc_title = ""
    body_start = pos
    fence_open: tuple[str, int] | None = None
    for line in text[pos:].splitlines(keepends=True):
        line_start, pos = pos, pos + len(line)
        if not markdown:
            continue
        m = _FENCE.match(line)
        if fence_open is not None:
            if (m and m.group(1)[0] == fence_open[0][0] and len(m.group(1)) >= len(fence_open[0])
                    and not line.strip()[len(m.group(1)):].strip()):
                fences.append((fence_open[1], pos))
                fence_open = None
            continue
        if m:
            fence_open = (m.group(1), line_start)
            continue
        h = _HEADING.match(line.rstrip("\r\n"))
        if not h:
            continue
        sections.append(Section(" > ".join(t for _, t in stack), body_start, line_start))
        level, htext = len(h.group(1)), (h.group(2) or "").strip()
        if level == 1 and not doc_title:
            doc_title = htext
        while stack and stack[-1][0] >= level:
            stack.pop()
        stack.append((level, htext))
        body_start = pos
    if fence_open is not None:
        fences.append((fence_open[1], len(text)))
    sections.append(Section(" > ".join(t for _, t in stack), body_start, len(text)))
    return doc_title or title, [s for s in sections if text[s.start : s.end].strip()], fences


# ----------------------------------------------------------------------------------- chunker

_PARA_BREAK = re.compile(r"\n[ \t]*\n\s*")
_SENT_BREAK = re.compile(r"(?<=[.!?:;])[\"')\]]*\s+(?=\S)|\n(?=[ \t]*(?:[-*+]|\d+[.)]|\|)[ \t])")


def whitespace_spans(text: str) -> list[tuple[int, int]]:
    """A tokenizer-free fallback: one token per run of word characters or punctuation mark."""
    return [m.span() for m in re.finditer(r"\w+|[^\w\s]", text)]


def hf_token_spans(tokenizer) -> TokenSpans:
    """Character spans of a Hugging Face tokenizer's tokens (fast tokenizers; else a word fallback)."""
    if not getattr(tokenizer, "is_fast", False):
        return whitespace_spans

    def spans(text: str) -> list[tuple[int, int]]:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        return [(int(a), int(b)) for a, b in enc["offset_mapping"] if b > a]

    return spans


class Chunker:
    """Splits documents into token-bounded chunks (see the module docstring).

    ``token_spans`` maps a text to the character spans of its tokens; pass the embedder's tokenizer through
    :func:`hf_token_spans` so that ``chunk_tokens`` counts what the embedder sees.
    """

    def __init__(self, config: ChunkingConfig | None = None, token_spans: TokenSpans | None = None):
        self.config = config or ChunkingConfig()
        self.token_spans = token_spans or whitespace_spans

    def chunk(self, doc: Document) -> list[Chunk]:
        text = doc.text.replace("\r\n", "\n")
        suffix = (doc.path.suffix if doc.path else Path(doc.source).suffix).lower()
        markdown = suffix in (".md", ".markdown", "")
        stem = Path(doc.source).stem.replace("_", " ").replace("-", " ")
        title, sections, fences = split_sections(text, markdown=markdown, title=stem)
        chunks: list[Chunk] = []
        for sec in sections:
            heading = sec.heading or title
            for a, b in self._split_span(text, sec.start, sec.end, fences):
                chunks.append(
                    Chunk(text=text[a:b], source=doc.source, position=len(chunks), heading=heading, title=title,
                          start=a, end=b)
                )
        return chunks

    def _split_span(self, text: str, start: int, end: int, fences: list[tuple[int, int]]) -> Iterable[tuple[int, int]]:
        body = text[start:end]
        spans = [(a + start, b + start) for a, b in self.token_spans(body)]
        n = len(spans)
        if n == 0:
            return []
        size, overlap = self.config.chunk_tokens, self.config.overlap
        if n <= size:
            return [(spans[0][0], spans[-1][1])]
        tok_starts = [a for a, _ in spans]

        def in_fence(c: int) -> bool:
            return any(fa < c < fb for fa, fb in fences)

        def breaks(pattern: re.Pattern) -> list[int]:
            out = set()
            for m in pattern.finditer(body):
                c = m.end() + start
                if in_fence(c):
                    continue
                t = bisect.bisect_left(tok_starts, c)
                if 0 < t < n:
                    out.add(t)
            return sorted(out)

        para = breaks(_PARA_BREAK)
        # A fence is one paragraph: breaks right before and after it count as paragraph breaks.
        for fa, fb in fences:
            for c in (fa, fb):
                if start < c < end:
                    t = bisect.bisect_left(tok_starts, c)
                    if 0 < t < n:
                        para.append(t)
        para = sorted(set(para))
        sent = sorted(set(breaks(_SENT_BREAK)) | set(para))

        def last_break(cands: list[int], lo: int, hi: int) -> int | None:
            i = bisect.bisect_right(cands, hi) - 1
            return cands[i] if i >= 0 and cands[i] >= lo else None

        out: list[tuple[int, int]] = []
        s = 0
        while True:
            if n - s <= size:
                out.append((s, n))
                break
            hi = s + size
            lo = s + max(1, size // 3)
            e = last_break(para, lo, hi) or last_break(sent, lo, hi) or hi
            out.append((s, e))
            if overlap <= 0:
                nxt = e
            else:
                # Start the next chunk at the first sentence start inside the overlap window, if any.
                i = bisect.bisect_left(sent, e - overlap)
                nxt = sent[i] if i < len(sent) and sent[i] < e else e - overlap
            s = max(nxt, s + 1)
        return [(spans[a][0], spans[b - 1][1]) for a, b in out]
