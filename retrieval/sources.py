"""Source ids: the stable name of a document in an index, which answers cite and `index delete` takes.

A file's source id is its path, in POSIX form,

* relative to the index root (the directory given to ``flowrt index build``) when the file lies under it;
* else relative to the deepest directory holding every path argument outside the root (a directory argument
  counts as itself, a file as its parent): ``add I teamA/notes.md teamB/notes.md`` gives ``teamA/notes.md``
  and ``teamB/notes.md``, ``add I more/`` gives the paths under ``more/``;

with ``PREFIX/`` in front when a source prefix is given. Without a prefix, a file the index already holds
(same absolute path) keeps its id, so an id does not depend on the other paths named or the working
directory. Two different files never get one id: that is a :class:`SourceConflictError` naming both.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import Iterable, Mapping, Sequence

from .chunking import Document
from .errors import SourceConflictError

__all__ = ["DOC_SUFFIXES", "read_documents", "check_prefix"]

#: File suffixes that ``read_documents`` picks up from a directory.
DOC_SUFFIXES = (".md", ".markdown", ".txt", ".rst")


def check_prefix(prefix: str | None) -> str | None:
    """A source prefix in normal form (no surrounding slashes), or ValueError naming what is wrong with it."""
    if prefix is None:
        return None
    p = prefix.strip("/")
    parts = PurePosixPath(p).parts
    if not p or "\\" in p or any(s in (".", "..") for s in parts) or p != "/".join(parts):
        raise ValueError(f"source prefix {prefix!r} must be a relative path like 'teamA' or 'docs/v2' "
                         "(no '.', '..' or backslashes)")
    return p


def _abs(p: Path) -> Path:
    """Absolute, with directories resolved but a file's own name kept (a linked file is known by its link)."""
    return p.resolve() if p.is_dir() else p.parent.resolve() / p.name


def _files(p: Path, suffixes: Sequence[str]) -> list[Path]:
    if p.is_dir():
        rels = (f.relative_to(p) for f in p.rglob("*") if f.is_file() and f.suffix.lower() in suffixes)
        return sorted(_abs(p) / r for r in rels if not any(s.startswith(".") for s in r.parts))
    if p.is_file():
        return [_abs(p)]
    raise FileNotFoundError(f"no such file or directory: {p}")


def read_documents(
    paths: Iterable[str | os.PathLike],
    *,
    root: str | os.PathLike | None = None,
    prefix: str | None = None,
    known: Mapping[str, str] | None = None,
    suffixes: Sequence[str] = DOC_SUFFIXES,
) -> list[Document]:
    """Read text documents from files and directories (recursively, ``suffixes`` only), ids per the module rules.

    ``known`` maps the absolute path of each file an index already holds to its source id.
    Each Document's ``path`` is the file's absolute path (its origin).
    """
    prefix = check_prefix(prefix)
    root_p = Path(root).resolve() if root else None
    args = [Path(p) for p in paths]
    files = [f for a in args for f in _files(a, suffixes)]
    outside = [_abs(a) if a.is_dir() else _abs(a).parent
               for a in args if root_p is None or not _abs(a).is_relative_to(root_p)]
    base = Path(os.path.commonpath(outside)) if outside else None
    by_id: dict[str, Document] = {}
    for f in files:
        if prefix is None and known and str(f) in known:
            sid = known[str(f)]
        else:
            if root_p is not None and f.is_relative_to(root_p):
                rel = f.relative_to(root_p)
            else:  # f is under an argument outside the root: base is those arguments' common folder
                assert base is not None
                rel = f.relative_to(base)
            sid = rel.as_posix() if prefix is None else f"{prefix}/{rel.as_posix()}"
        other = by_id.get(sid)
        if other is not None:
            if other.path == f:  # the same file named twice (a directory and a file in it)
                continue
            raise SourceConflictError(
                f"{other.path} and {f} would both be indexed as {sid!r}; add them in separate commands "
                "with different --source-prefix values"
            )
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{f} is not UTF-8 text ({e}); convert it or leave it out") from e
        by_id[sid] = Document(source=sid, text=text, path=f)
    return list(by_id.values())
