"""The Retriever: a document store plus a FAISS index plus an embedder, saved as one directory.

On disk an index is a directory::

    INDEX_DIR/
      manifest.json              format, version, embedder name and dimension, chunking settings,
                                 index kind and parameters, and the name, size and sha256 of each file below
      index-<gen>.faiss          the FAISS index (vector ids are chunk ids)
      chunks-<gen>.jsonl         one chunk per line: id, source, position, heading, title, start, end, text
      documents-<gen>.json       per source id: sha256 of its text, its chunk ids, and its origin
                                 (the file it was read from; None for texts)

Saving is atomic: the data files of a new generation are written (and fsynced) under new names, then
``manifest.json`` is replaced with one ``os.replace``, then data files that the committed manifest does not
name are deleted. A crash at any point leaves a directory whose manifest names complete files: the old
index or the new one, never a mix. A brand-new index is written into a temporary sibling directory and
renamed into place.

Writers take the index's lock (:mod:`.lock`) and save only over the generation they loaded, so concurrent
writers queue instead of losing each other's updates (:meth:`Retriever.updating` loads under the lock).
Readers take no lock: a load that loses a race with a writer's cleanup sees the manifest change and
loads the new generation.

Loading verifies everything the manifest promises and raises an :class:`IndexLoadError` subclass that
says what is wrong instead of returning wrong results. Format version 1 (no document origins) loads: a
document's origin is taken to be ``root/source`` where that file exists, else unknown; the next save
writes version 2.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from .chunking import Chunk, Chunker, ChunkingConfig, Document, hf_token_spans, whitespace_spans
from .embedder import Embedder, canonical_embedder_name, get_embedder
from .errors import (
    DimensionMismatchError,
    EmbedderMismatchError,
    EmbedderNotFoundError,
    IndexConflictError,
    IndexCorruptError,
    IndexNotFoundError,
    IndexVersionError,
    RetrievalError,
    SourceConflictError,
)
from .index import IndexParams, VectorIndex, resolve_kind
from .lock import DEFAULT_LOCK_TIMEOUT, IndexLock
from .sources import read_documents

__all__ = ["Retriever", "AddReport", "FORMAT", "FORMAT_VERSION", "MANIFEST"]

FORMAT = "flowrt.retrieval.index"
FORMAT_VERSION = 2  #: 2: documents record their origin file
_LOAD_TRIES = 5  #: loads retried when a writer replaced the manifest mid-load
MANIFEST = "manifest.json"
_DATA_PREFIXES = ("index-", "chunks-", "documents-", MANIFEST + ".tmp-")


@dataclass
class AddReport:
    """What an add did: sources added, replaced (text changed) and unchanged (skipped), chunks embedded."""

    added: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    chunks: int = 0
    seconds: float = 0.0
    origins: dict[str, str] = field(default_factory=dict)  #: source id -> file it was read from

    def per_file(self) -> list[str]:
        """One line per document: what happened to it, its source id, and the file it came from."""
        rows = [(what, s) for what, names in (("added", self.added), ("replaced", self.replaced),
                                              ("unchanged", self.unchanged)) for s in names]
        return [f"{what:<9}  {s}" + (f"  <- {self.origins[s]}" if s in self.origins else "")
                for what, s in sorted(rows, key=lambda r: r[1])]

    def __str__(self) -> str:
        return (
            f"{len(self.added)} added, {len(self.replaced)} replaced, {len(self.unchanged)} unchanged; "
            f"{self.chunks} chunks embedded in {self.seconds:.1f}s"
        )


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class Retriever:
    """Semantic search over chunked documents.

    >>> r = Retriever.load("index/")                 # doctest: +SKIP
    >>> for c in r.search_sync("how does prefix caching work?", k=4):   # doctest: +SKIP
    ...     print(c.score, c.source, c.heading)
    >>> chunks = await r.search("question", k=4)    # in async code (work runs in a worker thread)  # doctest: +SKIP

    Build one with :meth:`build` (or :meth:`create` then :meth:`add`), persist it with :meth:`save`.
    """

    def __init__(
        self,
        *,
        embedder: str | os.PathLike | Embedder | Any | None = None,
        chunking: ChunkingConfig | None = None,
        params: IndexParams | None = None,
        dim: int | None = None,
        path: str | os.PathLike | None = None,
    ):
        self._embedder_spec = embedder
        self._embedder: Embedder | Any | None = None  # Any: a user's object with the Embedder methods
        if embedder is None or isinstance(embedder, (str, os.PathLike)):
            self.embedder_name: str = canonical_embedder_name(embedder)
        else:
            self._embedder = embedder
            self.embedder_name = embedder.name
        self.chunking = chunking or ChunkingConfig()
        self._params = params or IndexParams(kind="auto")
        self._dim = dim
        self._vindex: VectorIndex | None = None
        self._chunks: dict[int, Chunk] = {}
        self._docs: dict[str, dict[str, Any]] = {}
        self._next_id = 0
        self.path: Path | None = Path(path) if path is not None else None
        self.root: str | None = None
        self.generation = 0
        self._base: tuple[int, str] | None = None  # the committed generation this retriever holds (see save)
        self.created_at: str | None = None
        self._lock = threading.RLock()

    # ================================================================== construction
    @classmethod
    def create(
        cls,
        *,
        embedder: str | os.PathLike | Embedder | Any | None = None,
        chunk_tokens: int = 192,
        overlap: int = 32,
        kind: str = "auto",
        **index_params,
    ) -> "Retriever":
        """An empty in-memory retriever. ``kind``: auto | flat | ivf | hnsw (auto decides at the first add)."""
        if kind.lower() not in ("auto", "flat", "ivf", "hnsw"):
            resolve_kind(kind, 0)  # raises with the list of kinds
        return cls(
            embedder=embedder,
            chunking=ChunkingConfig(chunk_tokens=chunk_tokens, overlap=overlap),
            params=IndexParams(kind=kind.lower(), **{k: v for k, v in index_params.items() if v is not None}),
        )

    @classmethod
    def build(
        cls,
        docs: str | os.PathLike | Iterable[str | os.PathLike] | Iterable[Document],
        output: str | os.PathLike | None = None,
        *,
        embedder: str | os.PathLike | Embedder | Any | None = None,
        chunk_tokens: int = 192,
        overlap: int = 32,
        kind: str = "auto",
        progress: bool | None = None,
        source_prefix: str | None = None,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
        **index_params,
    ) -> "Retriever":
        """Chunk, embed and index documents (a directory, files, or Document objects); save to ``output`` if given.

        Source ids follow :mod:`.sources`: for one directory, paths relative to it (the index's root).
        """
        r = cls.create(embedder=embedder, chunk_tokens=chunk_tokens, overlap=overlap, kind=kind, **index_params)
        items: list[Any] = [docs] if isinstance(docs, (str, os.PathLike)) else list(docs)  # paths or Documents
        if items and not isinstance(items[0], Document):
            dirs = [Path(d) for d in items if Path(d).is_dir()]
            if len(dirs) == 1 and len(items) == 1:
                r.root = str(dirs[0].resolve())
            documents = read_documents(items, root=r.root, prefix=source_prefix)
            if not documents:
                raise RetrievalError(
                    f"no documents found in {', '.join(map(str, items))} (looked for *.md, *.markdown, *.txt, *.rst)"
                )
        else:
            documents = items
        r.add_documents(documents, progress=progress)
        if output is not None:
            r.save(output, lock_timeout=lock_timeout)
        return r

    # ================================================================== embedder
    @property
    def embedder(self):
        """The embedder (loaded on first use; the model is shared per process)."""
        if self._embedder is None:
            try:
                spec = self._embedder_spec if self._embedder_spec is not None else self.embedder_name
                self._embedder = get_embedder(spec)
            except EmbedderNotFoundError as e:
                where = f"the index at {self.path}" if self.path else "this index"
                raise EmbedderNotFoundError(
                    f"{where} was built with the embedder {self.embedder_name!r}, which is not available here "
                    f"({e}); pass embedder=... (--embedder DIR) naming a local copy of the same model"
                ) from e
            if self._dim is not None and self._embedder.dim != self._dim:
                raise DimensionMismatchError(
                    f"the embedder {self._embedder.name!r} makes {self._embedder.dim}-dimensional vectors but "
                    f"{'the index at ' + str(self.path) if self.path else 'this index'} "
                    f"holds {self._dim}-dimensional ones"
                )
        return self._embedder

    @property
    def dim(self) -> int:
        if self._dim is None:
            self._dim = int(self.embedder.dim)
        return self._dim

    def _embed(self, texts: Sequence[str], progress: bool | None = None) -> np.ndarray:
        vecs = np.asarray(self.embedder.encode(list(texts), progress=progress), dtype=np.float32)
        if vecs.ndim != 2 or vecs.shape[1] != self.dim:
            raise DimensionMismatchError(
                f"the embedder {self.embedder_name!r} returned vectors of shape {vecs.shape}; "
                f"the index expects dimension {self.dim}"
            )
        return vecs

    def _chunker(self) -> Chunker:
        tok = getattr(self.embedder, "tokenizer", None)
        spans = hf_token_spans(tok) if tok is not None else whitespace_spans
        max_len = getattr(self.embedder, "max_seq_length", None)
        if isinstance(max_len, int) and self.chunking.chunk_tokens > max_len:
            raise ValueError(
                f"chunk_tokens={self.chunking.chunk_tokens} exceeds the embedder's maximum sequence length "
                f"({max_len} tokens): the end of every chunk would be ignored. Use --chunk-tokens {max_len} or less"
            )
        return Chunker(self.chunking, spans)

    @staticmethod
    def _embed_text(c: Chunk) -> str:
        return f"{c.heading}\n{c.text}" if c.heading else c.text

    # ================================================================== documents
    def add(
        self,
        paths: str | os.PathLike | Iterable[str | os.PathLike],
        *,
        source_prefix: str | None = None,
        replace: bool = False,
        progress: bool | None = None,
    ) -> AddReport:
        """Add (or update) documents from files and directories, identified by source id (:mod:`.sources`).

        A source already indexed with the same text is skipped; with different text its old chunks are
        replaced. A file never replaces a document read from another file unless ``replace`` is true.
        """
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        with self._lock:
            known = {d["origin"]: s for s, d in self._docs.items() if d.get("origin")}
            docs = read_documents(list(paths), root=self.root, prefix=source_prefix, known=known)
            return self.add_documents(docs, replace=replace, progress=progress)

    def add_texts(self, texts: Sequence[str], sources: Sequence[str] | None = None, *,
                  progress: bool | None = None) -> AddReport:
        """Add raw texts as documents (sources default to ``text-<i>``)."""
        sources = list(sources) if sources is not None else [f"text-{i}" for i in range(len(texts))]
        if len(sources) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(sources)} sources")
        return self.add_documents([Document(source=s, text=t) for s, t in zip(sources, texts)], progress=progress)

    def add_documents(self, documents: Iterable[Document], *, replace: bool = False,
                      progress: bool | None = None) -> AddReport:
        """Add Documents by source id; one whose ``path`` differs from the indexed one's is refused unless
        ``replace``."""
        t0 = time.perf_counter()
        report = AddReport()
        documents = list(documents)
        with self._lock:
            if not replace:
                self._refuse_foreign(documents)
            todo: list[tuple[Document, str]] = []
            seen: set[str] = set()
            for d in documents:
                if d.source in seen:
                    raise ValueError(f"source {d.source!r} given twice")
                seen.add(d.source)
                if d.path is not None:
                    report.origins[d.source] = str(d.path)
                digest = _sha256_text(d.text)
                old = self._docs.get(d.source)
                if old is not None and old["sha256"] == digest:
                    report.unchanged.append(d.source)
                    continue
                (report.replaced if old is not None else report.added).append(d.source)
                todo.append((d, digest))
            if not todo:
                report.seconds = time.perf_counter() - t0
                return report
            chunker = self._chunker()
            new_chunks: list[Chunk] = []
            per_doc: list[tuple[Document, str, list[Chunk]]] = []
            for d, digest in todo:
                cs = chunker.chunk(d)
                ids = range(self._next_id + len(new_chunks), self._next_id + len(new_chunks) + len(cs))
                cs = [Chunk(**{**c.to_dict(), "id": i}) for c, i in zip(cs, ids)]
                new_chunks.extend(cs)
                per_doc.append((d, digest, cs))
            vecs = self._embed([self._embed_text(c) for c in new_chunks], progress=progress)
            if self._vindex is None:
                kind = resolve_kind(self._params.kind, len(self._chunks) + len(new_chunks))
                self._params.kind = kind
                self._vindex = VectorIndex(self.dim, self._params)
            # Replace changed documents: drop their old chunks first.
            stale = [i for d, _, _ in per_doc if d.source in self._docs for i in self._docs[d.source]["ids"]]
            if stale:
                self._vindex.remove(stale)
                for i in stale:
                    self._chunks.pop(i, None)
            self._vindex.add(vecs, np.array([c.id for c in new_chunks], dtype=np.int64))
            for d, digest, cs in per_doc:
                origin = str(d.path) if d.path is not None else None
                self._docs[d.source] = {"sha256": digest, "ids": [c.id for c in cs],
                                        "title": cs[0].title if cs else "", "origin": origin}
                for c in cs:
                    self._chunks[c.id] = c
            self._next_id += len(new_chunks)
            report.chunks = len(new_chunks)
        report.seconds = time.perf_counter() - t0
        return report

    def _refuse_foreign(self, documents: Sequence[Document]) -> None:
        """Raise SourceConflictError if a document would replace one indexed from a different file."""
        clashes = []
        for d in documents:
            old = self._docs.get(d.source, {}).get("origin")
            if d.path is not None and old is not None and old != str(d.path):
                clashes.append(f"{d.source!r} is indexed from {old}, not {d.path}")
        if clashes:
            raise SourceConflictError(
                "refusing to replace documents with files at other paths: " + "; ".join(clashes)
                + ". Index them under other ids with --source-prefix NAME (source_prefix=), or pass --replace "
                "(replace=True) if they are the same documents moved"
            )

    def delete(self, sources: str | Iterable[str]) -> int:
        """Remove documents by source; returns the number of chunks removed. Unknown sources raise KeyError."""
        if isinstance(sources, str):
            sources = [sources]
        sources = list(sources)
        with self._lock:
            missing = [s for s in sources if s not in self._docs]
            if missing:
                raise KeyError(f"not in the index: {', '.join(missing)} (see `flowrt index info` for the sources)")
            ids = [i for s in sources for i in self._docs[s]["ids"]]
            if self._vindex is not None and ids:
                self._vindex.remove(ids)
            for s in sources:
                for i in self._docs.pop(s)["ids"]:
                    self._chunks.pop(i, None)
            return len(ids)

    @property
    def sources(self) -> list[str]:
        return sorted(self._docs)

    def chunks(self, source: str | None = None) -> list[Chunk]:
        """Stored chunks (of one source, or all), in source and position order."""
        with self._lock:
            if source is not None:
                return [self._chunks[i] for i in self._docs[source]["ids"]]
            return sorted(self._chunks.values(), key=lambda c: (c.source, c.position))

    def __len__(self) -> int:
        return len(self._chunks)

    @property
    def kind(self) -> str:
        return self._vindex.kind if self._vindex is not None else self._params.kind

    # ================================================================== search
    def search_sync(self, query: str, k: int = 4, **kw) -> list[Chunk]:
        """The ``k`` chunks most similar to ``query``, best first, each with ``.score`` (cosine similarity)."""
        return self.search_many_sync([query], k, **kw)[0]

    def search_many_sync(self, queries: Sequence[str], k: int = 4, *, nprobe: int | None = None,
                         ef_search: int | None = None) -> list[list[Chunk]]:
        if isinstance(queries, str):
            raise TypeError("search_many_sync takes a list of queries; use search_sync for one")
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        for q in queries:
            if not isinstance(q, str):
                raise TypeError(f"a query must be a str, got {type(q).__name__}")
        if not queries or self._vindex is None or len(self._chunks) == 0:
            return [[] for _ in queries]
        qv = self._embed(list(queries))
        with self._lock:
            scores, ids = self._vindex.search(qv, k, nprobe=nprobe, ef_search=ef_search)
            return [
                [self._chunks[int(i)].with_score(float(s))
                 for s, i in zip(ds, is_) if i >= 0 and int(i) in self._chunks]
                for ds, is_ in zip(scores, ids)
            ]

    async def search(self, query: str, k: int = 4, **kw) -> list[Chunk]:
        """Async :meth:`search_sync`: the embedding and the FAISS search run in a worker thread."""
        import anyio.to_thread

        return await anyio.to_thread.run_sync(lambda: self.search_sync(query, k, **kw))

    async def search_many(self, queries: Sequence[str], k: int = 4, **kw) -> list[list[Chunk]]:
        import anyio.to_thread

        return await anyio.to_thread.run_sync(lambda: self.search_many_sync(queries, k, **kw))

    # ================================================================== info
    def info(self) -> dict[str, Any]:
        return {
            "path": str(self.path) if self.path else None,
            "format_version": FORMAT_VERSION,
            "embedder": {"name": self.embedder_name, "dim": self._dim},
            "chunking": self.chunking.to_dict(),
            "index": {**(self._vindex.params if self._vindex else self._params).to_dict(),
                      "ntotal": len(self._vindex or ())},
            "documents": len(self._docs),
            "chunks": len(self._chunks),
            "generation": self.generation,
            "root": self.root,
        }

    def __repr__(self) -> str:
        where = f" at {self.path}" if self.path else ""
        return (f"<Retriever{where}: {len(self._docs)} documents, {len(self._chunks)} chunks, {self.kind}, "
                f"{self.embedder_name}>")

    # ================================================================== persistence
    def save(self, path: str | os.PathLike | None = None, *, lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> Path:
        """Write the index directory atomically (see the module docstring) under its writer lock. Returns its path.

        Saving back to the directory this retriever was loaded from raises :class:`IndexConflictError` if
        another writer committed there since: saving would drop that writer's change.
        """
        target = Path(path) if path is not None else self.path
        if target is None:
            raise ValueError("save() needs a path (this retriever was never loaded from or saved to one)")
        target.parent.mkdir(parents=True, exist_ok=True)
        with IndexLock(target, timeout=lock_timeout), self._lock:
            if target.exists():
                if not target.is_dir():
                    raise RetrievalError(f"cannot save an index to {target}: it is a file")
                if any(target.iterdir()) and not (target / MANIFEST).is_file():
                    raise RetrievalError(
                        f"refusing to save an index into {target}: the directory is not empty and holds no flowrt index"
                    )
                committed = _read_manifest(target)
                self._check_base(target, committed)
                gen = int(committed["generation"]) + 1 if committed else self.generation + 1
                self._write_generation(target, gen)
            else:
                tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
                tmp.mkdir()
                try:
                    gen = 1
                    self._write_generation(tmp, gen)
                    os.rename(tmp, target)
                    _fsync_dir(target.parent)
                except BaseException:
                    for f in tmp.glob("*"):
                        f.unlink(missing_ok=True)
                    tmp.rmdir() if tmp.exists() else None
                    raise
            self.generation = gen
            self.path = target
            return target

    def _check_base(self, target: Path, committed: dict[str, Any] | None) -> None:
        if self.path is None or self._base is None or target.resolve() != self.path.resolve():
            return  # a new index, or a save over another one: it replaces what is there
        now = _tag(committed)
        if now != self._base:
            what = f"generation {committed['generation']}" if committed else "an unreadable manifest"
            raise IndexConflictError(
                f"the index at {target} changed since this Retriever loaded it (generation {self.generation}, now "
                f"{what}): another writer committed, and saving would lose its change. Load it again and redo "
                f"this change (Retriever.updating({str(target)!r}) loads under the writer lock)"
            )

    @classmethod
    @contextmanager
    def updating(cls, path: str | os.PathLike, *, timeout: float = DEFAULT_LOCK_TIMEOUT,
                 **load_kw) -> Iterator["Retriever"]:
        """Hold the index's writer lock, load the committed index, yield it; ``save()`` inside commits the change.

        Every read-modify-write of an index shared between processes goes through this, so that no writer
        works on a generation another has already replaced.
        """
        with IndexLock(path, timeout=timeout):
            yield cls.load(path, **load_kw)

    def _write_generation(self, d: Path, gen: int) -> None:
        tag = f"{gen:06d}-{uuid.uuid4().hex[:6]}"
        names = {"index": f"index-{tag}.faiss", "chunks": f"chunks-{tag}.jsonl", "documents": f"documents-{tag}.json"}
        vindex = self._vindex or VectorIndex(self.dim, IndexParams(kind=resolve_kind(self._params.kind, 0)))
        vindex.write(str(d / names["index"]))
        with open(d / names["index"], "rb+") as f:
            os.fsync(f.fileno())
        lines = [json.dumps(c.to_dict(), ensure_ascii=False) for c in self.chunks()]
        _write_bytes(d / names["chunks"], ("\n".join(lines) + ("\n" if lines else "")).encode("utf-8"))
        _write_bytes(d / names["documents"], json.dumps(self._docs, ensure_ascii=False, sort_keys=True).encode("utf-8"))
        files = {
            key: {"name": name, "bytes": (d / name).stat().st_size, "sha256": _sha256_file(d / name)}
            for key, name in names.items()
        }
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.created_at = self.created_at or now
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "created_by": _flowrt_version(),
            "created_at": self.created_at,
            "updated_at": now,
            "generation": gen,
            "embedder": {"name": self.embedder_name, "dim": self.dim},
            "chunking": {**self.chunking.to_dict(), "tokenizer": self.embedder_name},
            "index": {**vindex.params.to_dict(), "ntotal": vindex.ntotal},
            "documents": len(self._docs),
            "chunks": len(self._chunks),
            "next_id": self._next_id,
            "root": self.root,
            "files": files,
        }
        tmp = d / f"{MANIFEST}.tmp-{uuid.uuid4().hex[:8]}"
        _write_bytes(tmp, (json.dumps(manifest, indent=2) + "\n").encode("utf-8"))
        os.replace(tmp, d / MANIFEST)  # the commit point
        _fsync_dir(d)
        self._base = _tag(manifest)
        _sweep(d, set(names.values()))

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        *,
        embedder: str | os.PathLike | Embedder | Any | None = None,
        verify: bool = True,
        nprobe: int | None = None,
        ef_search: int | None = None,
    ) -> "Retriever":
        """Open a saved index directory.

        ``embedder``: by default the one named in the manifest; if given, it must be the same model (by name).
        ``verify``: check every file's size and sha256 against the manifest (sizes are always checked).
        ``nprobe`` / ``ef_search``: override the saved IVF / HNSW search parameters.
        Raises an :class:`IndexLoadError` subclass when the directory cannot be used.
        """
        p = Path(path)
        if not p.exists():
            raise IndexNotFoundError(f"no index at {p}: the directory does not exist "
                                     f"(build one with `flowrt index build DOCS_DIR -o {p}`)")
        if not p.is_dir():
            raise IndexNotFoundError(f"{p} is a file; an index is a directory holding {MANIFEST}")
        for attempt in range(_LOAD_TRIES):
            raw = _manifest_bytes(p)
            try:
                return cls._load_once(p, raw, embedder=embedder, verify=verify, nprobe=nprobe, ef_search=ef_search)
            except IndexCorruptError:
                if attempt == _LOAD_TRIES - 1 or _manifest_bytes(p) == raw:
                    raise  # the manifest did not move under us: the index really is broken
        raise AssertionError("unreachable")  # pragma: no cover

    @classmethod
    def _load_once(cls, p: Path, raw: bytes | None, *, embedder, verify: bool, nprobe: int | None,
                   ef_search: int | None) -> "Retriever":
        mpath = p / MANIFEST
        if raw is None:
            raise IndexNotFoundError(f"{p} is not a flowrt index: {MANIFEST} is missing "
                                     f"(build one with `flowrt index build DOCS_DIR -o {p}`)")
        try:
            m = json.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise IndexCorruptError(f"{mpath} is corrupt or truncated (not valid JSON: {e}); rebuild the index") from e
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            found = m.get("format") if isinstance(m, dict) else None
            raise IndexCorruptError(
                f"{mpath} is not a flowrt index manifest (format is {found!r}, expected {FORMAT!r})")
        ver = m.get("format_version")
        if not isinstance(ver, int) or ver < 1:
            raise IndexCorruptError(f"{mpath} has an invalid format_version {ver!r}")
        if ver > FORMAT_VERSION:
            raise IndexVersionError(
                f"the index at {p} uses format version {ver}, written by {m.get('created_by') or 'a newer flowrt'}; "
                f"this flowrt ({_flowrt_version()}) reads format versions up to {FORMAT_VERSION}. "
                "Upgrade flowrt or rebuild the index"
            )
        try:
            emb_name = str(m["embedder"]["name"])
            dim = int(m["embedder"]["dim"])
            chunking = ChunkingConfig(chunk_tokens=int(m["chunking"]["chunk_tokens"]),
                                      overlap=int(m["chunking"]["overlap"]))
            params = IndexParams.from_dict(m["index"])
            files = {k: m["files"][k] for k in ("index", "chunks", "documents")}
            for f in files.values():
                f["name"], f["bytes"], f["sha256"]  # noqa: B018
        except (KeyError, TypeError, ValueError) as e:
            raise IndexCorruptError(
                f"{mpath} is missing or has a bad field ({type(e).__name__}: {e}); rebuild the index") from e
        if dim < 1:
            raise IndexCorruptError(f"{mpath} records an invalid embedding dimension {dim}")

        # The embedder: the caller's must be the manifest's.
        if embedder is not None:
            name = embedder.name if not isinstance(embedder, (str, os.PathLike)) else canonical_embedder_name(embedder)
            if name != emb_name:
                raise EmbedderMismatchError(
                    f"the index at {p} was built with the embedder {emb_name!r}, not {name!r}: its vectors are not "
                    "comparable with that model's. Query it with the same embedder, "
                    "or rebuild the index with the new one"
                )
            edim = getattr(embedder, "dim", None) if not isinstance(embedder, (str, os.PathLike)) else None
            if edim is not None and int(edim) != dim:
                raise DimensionMismatchError(f"the embedder {name!r} makes {edim}-dimensional vectors "
                                             f"but the index at {p} holds {dim}-dimensional ones")

        # Files: present, complete, intact.
        for key, f in files.items():
            fp = p / f["name"]
            try:
                size = fp.stat().st_size
                if size != f["bytes"]:
                    what = "truncated" if size < f["bytes"] else "larger than recorded"
                    raise IndexCorruptError(
                        f"{fp} is {what}: {size} bytes, the manifest records {f['bytes']}; rebuild the index")
                if verify and _sha256_file(fp) != f["sha256"]:
                    raise IndexCorruptError(
                        f"{fp} is corrupt: its sha256 does not match the manifest; rebuild the index")
            except OSError as e:
                raise IndexCorruptError(f"the index at {p} is incomplete: {f['name']} ({key}) is missing "
                                        f"({e.strerror}); rebuild the index") from e

        if nprobe is not None:
            params.nprobe = int(nprobe)
        if ef_search is not None:
            params.ef_search = int(ef_search)
        try:
            vindex = VectorIndex.read(str(p / files["index"]["name"]), params)
        except Exception as e:
            raise IndexCorruptError(
                f"{p / files['index']['name']} is not a readable FAISS index ({e}); rebuild the index") from e
        if vindex.dim != dim:
            raise DimensionMismatchError(
                f"the index at {p} is inconsistent: its FAISS index has dimension {vindex.dim} "
                f"but the manifest records {dim} for the embedder {emb_name!r}; rebuild the index"
            )
        try:
            lines = (p / files["chunks"]["name"]).read_text(encoding="utf-8").splitlines()
            chunks = [Chunk.from_dict(json.loads(line)) for line in lines if line.strip()]
            docs = json.loads((p / files["documents"]["name"]).read_text(encoding="utf-8"))
            if not isinstance(docs, dict):
                raise ValueError("documents is not a JSON object")
        except (ValueError, TypeError, UnicodeDecodeError, OSError) as e:
            raise IndexCorruptError(
                f"the document store of the index at {p} cannot be read ({e}); rebuild the index") from e
        if vindex.ntotal != len(chunks) or sum(len(d["ids"]) for d in docs.values()) != len(chunks):
            raise IndexCorruptError(
                f"the index at {p} is inconsistent: {vindex.ntotal} vectors, {len(chunks)} stored chunks, "
                f"{sum(len(d['ids']) for d in docs.values())} chunks listed by documents; rebuild the index"
            )

        r = cls(embedder=embedder, chunking=chunking, params=vindex.params, dim=dim, path=p)
        if embedder is None:  # resolved on first use, so an index can be inspected without its model
            r._embedder_spec = r.embedder_name = emb_name
        r._vindex = vindex
        r._chunks = {c.id: c for c in chunks}
        r._docs = docs
        r._next_id = int(m.get("next_id", max(r._chunks, default=-1) + 1))
        r.root = m.get("root")
        r.generation = int(m.get("generation", 0))
        r.created_at = m.get("created_at")
        r._base = _tag(m)
        if ver == 1:
            _migrate_v1_origins(docs, r.root)
        return r


def _migrate_v1_origins(docs: dict[str, dict[str, Any]], root: str | None) -> None:
    """Version 1 kept no origins. A source under the root was named relative to it, so ``root/source`` is its
    origin where that file exists; any other origin stays unknown (None), which never blocks a replace."""
    for source, d in docs.items():
        guess = Path(root) / source if root else None
        d["origin"] = str(guess) if guess is not None and guess.is_file() else None


def _manifest_bytes(d: Path) -> bytes | None:
    try:
        return (d / MANIFEST).read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _read_manifest(d: Path) -> dict[str, Any] | None:
    """The committed manifest of directory ``d``, or None when there is none or it does not parse."""
    raw = _manifest_bytes(d)
    try:
        m = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return m if isinstance(m, dict) else None


def _tag(m: dict[str, Any] | None) -> tuple[int, str] | None:
    """What identifies a committed generation: its number and its (randomly tagged) FAISS file name."""
    if m is None:
        return None
    try:
        return int(m["generation"]), str(m["files"]["index"]["name"])
    except (TypeError, KeyError, ValueError):
        return None


def _sweep(d: Path, keep: set[str]) -> None:
    """Delete data files of other generations (and crashed saves), never one the committed manifest names."""
    committed = _read_manifest(d) or {}
    files = committed.get("files")
    if isinstance(files, dict):
        keep |= {f["name"] for f in files.values() if isinstance(f, dict) and "name" in f}
    for f in d.iterdir():
        if f.name != MANIFEST and f.name not in keep and f.name.startswith(_DATA_PREFIXES):
            f.unlink(missing_ok=True)


def _flowrt_version() -> str:
    try:
        from importlib.metadata import version

        return f"flowrt {version('flowrt')}"
    except ImportError:  # pragma: no cover - PackageNotFoundError: not installed as a distribution
        return "flowrt"
