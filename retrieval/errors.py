"""Exceptions raised by flowrt.retrieval.

Every error names the index directory or file it is about and says what to do next.
``IndexLoadError`` and its subclasses are raised only while opening an index, so a caller
can catch that one class to tell "this index cannot be used" from a bad query.
"""

from __future__ import annotations

__all__ = [
    "RetrievalError",
    "IndexLoadError",
    "IndexNotFoundError",
    "IndexCorruptError",
    "IndexVersionError",
    "EmbedderMismatchError",
    "DimensionMismatchError",
    "EmbedderNotFoundError",
    "IndexLockedError",
    "IndexConflictError",
    "SourceConflictError",
]


class RetrievalError(Exception):
    """Base class of every error raised by flowrt.retrieval."""


class EmbedderNotFoundError(RetrievalError, FileNotFoundError):
    """The embedding model named by the caller (or an index's manifest) is not on this machine."""


class IndexLoadError(RetrievalError):
    """An index directory cannot be used. Subclasses say why."""


class IndexNotFoundError(IndexLoadError, FileNotFoundError):
    """No index (no manifest.json) at the given path."""


class IndexCorruptError(IndexLoadError):
    """A file of the index is missing, truncated, fails its checksum, or does not parse."""


class IndexVersionError(IndexLoadError):
    """The index was written in a format newer than this flowrt understands."""


class EmbedderMismatchError(IndexLoadError):
    """The embedder requested by the caller is not the one the index was built with."""


class DimensionMismatchError(IndexLoadError):
    """Vector dimensions disagree (manifest, FAISS index, or embedder)."""


class IndexLockedError(RetrievalError, TimeoutError):
    """Another writer held the index's lock for longer than the caller was willing to wait."""

    def __init__(self, message: str, pid: int | None = None):
        super().__init__(message)
        self.pid = pid


class IndexConflictError(RetrievalError):
    """Another writer committed to the index since this Retriever loaded it; saving would lose that change."""


class SourceConflictError(RetrievalError, ValueError):
    """Two different files would get the same source id, or a file would silently replace another's document."""
