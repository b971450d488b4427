"""Document identity: stable source ids, no silent replacement by another file, per-file reports,
and indexes of format version 1 (issue 11, item 3)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

pytest.importorskip("faiss")
pytest.importorskip("sentence_transformers")

from flowrt.retrieval import Retriever, SourceConflictError, read_documents
from support import retrieval_cli as _cli


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture()
def corpus_index(tmp_path) -> Path:
    docs = tmp_path / "corpus"
    _write(docs / "engine.md", "# Engine\n\nThe engine batches requests continuously and shares KV blocks.\n")
    _write(docs / "rag.md", "# RAG\n\nRetrieved chunks are rendered in a stable order by source.\n")
    Retriever.build(docs, tmp_path / "idx", progress=False)
    return tmp_path / "idx"


def test_same_file_name_in_two_directories_keeps_both(corpus_index, tmp_path, capsys):
    a = _write(tmp_path / "teamA" / "notes.md", "# Team A\n\nTeam A ships the scheduler on Mondays.\n")
    b = _write(tmp_path / "teamB" / "notes.md", "# Team B\n\nTeam B owns the tokenizer and its tests.\n")
    assert _cli("index", "add", corpus_index, a, b) == 0
    err = capsys.readouterr().err
    assert "2 added" in err
    assert f"added      teamA/notes.md  <- {a}" in err and f"added      teamB/notes.md  <- {b}" in err
    r = Retriever.load(corpus_index)
    assert r.sources == ["engine.md", "rag.md", "teamA/notes.md", "teamB/notes.md"]
    # Naming one of them again, alone, finds it under the id it already has (not "notes.md").
    assert _cli("index", "add", corpus_index, a) == 0
    assert "unchanged  teamA/notes.md" in capsys.readouterr().err
    assert len(Retriever.load(corpus_index).sources) == 4


def test_unrelated_file_with_an_indexed_name_is_not_replaced(corpus_index, tmp_path, capsys):
    other = tmp_path / "vendor"
    _write(other / "engine.md", "# Car engines\n\nA diesel engine ignites fuel by compression.\n")
    before = Retriever.load(corpus_index).chunks("engine.md")
    assert _cli("index", "add", corpus_index, other) == 1
    err = capsys.readouterr().err
    assert "refusing to replace" in err
    assert str(tmp_path / "corpus" / "engine.md") in err and str(other / "engine.md") in err
    assert "--source-prefix" in err and "Traceback" not in err
    assert Retriever.load(corpus_index).chunks("engine.md") == before  # nothing changed

    assert _cli("index", "add", corpus_index, other, "--source-prefix", "vendor") == 0
    assert "added      vendor/engine.md" in capsys.readouterr().err
    r = Retriever.load(corpus_index)
    assert r.chunks("engine.md") == before and "compression" in r.chunks("vendor/engine.md")[0].text

    # --replace says "this is the same document, moved": it replaces, and the new path becomes its origin.
    moved = _write(tmp_path / "moved" / "engine.md", "# Engine\n\nThe engine batches requests and preempts.\n")
    assert _cli("index", "add", corpus_index, moved, "--replace") == 0
    assert "replaced   engine.md" in capsys.readouterr().err
    assert "preempts" in Retriever.load(corpus_index).chunks("engine.md")[0].text
    assert _cli("index", "add", corpus_index, moved.parent) == 0  # now its own file: no --replace needed
    assert "unchanged  engine.md" in capsys.readouterr().err
    with pytest.raises(ValueError, match="source prefix"):
        Retriever.load(corpus_index).add(other, source_prefix="../up")


def test_add_reports_each_file(corpus_index, tmp_path, capsys):
    docs = tmp_path / "corpus"
    _write(docs / "rag.md", "# RAG\n\nChunks are ordered by source and position, never by score.\n")
    _write(docs / "server.md", "# Server\n\nThe HTTP server speaks the OpenAI protocol.\n")
    assert _cli("index", "add", corpus_index, docs) == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "  <- " in ln]
    assert lines == [
        f"unchanged  engine.md  <- {docs / 'engine.md'}",
        f"replaced   rag.md  <- {docs / 'rag.md'}",
        f"added      server.md  <- {docs / 'server.md'}",
    ]


def test_two_files_with_one_id_is_an_error(tmp_path):
    root = tmp_path / "root"
    inside = _write(root / "notes.md", "inside")
    outside = _write(tmp_path / "elsewhere" / "notes.md", "outside")
    with pytest.raises(SourceConflictError, match=r"would both be indexed as 'notes.md'"):
        read_documents([inside, outside], root=root)
    # The same file named twice (a directory and a file in it) is one document.
    assert [d.source for d in read_documents([root, inside], root=root)] == ["notes.md"]


def _rewrite_as_v1(index: Path) -> None:
    """What the format-1 code wrote: no origins in the document table, format_version 1."""
    m = json.loads((index / "manifest.json").read_text())
    f = index / m["files"]["documents"]["name"]
    docs = json.loads(f.read_text())
    for d in docs.values():
        d.pop("origin")
    data = json.dumps(docs, sort_keys=True).encode()
    f.write_bytes(data)
    m["files"]["documents"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    m["format_version"] = 1
    (index / "manifest.json").write_text(json.dumps(m))


@pytest.mark.slow
def test_format_1_index_loads_with_origins_migrated(corpus_index, tmp_path, capsys):
    _rewrite_as_v1(corpus_index)
    r = Retriever.load(corpus_index)
    assert r.sources == ["engine.md", "rag.md"] and r.search_sync("stable order", k=1)[0].source == "rag.md"
    # The migration knows engine.md came from the root, so an unrelated engine.md is still refused...
    other = _write(tmp_path / "vendor" / "engine.md", "# Car engines\n\nDiesel.\n")
    with pytest.raises(SourceConflictError, match="refusing to replace"):
        r.add(other)
    # ...while the root's own file updates it, and the next save writes format 2 with origins.
    _write(tmp_path / "corpus" / "engine.md", "# Engine\n\nThe engine now also preempts.\n")
    assert _cli("index", "add", corpus_index, tmp_path / "corpus" / "engine.md") == 0
    assert "replaced   engine.md" in capsys.readouterr().err
    m = json.loads((corpus_index / "manifest.json").read_text())
    assert m["format_version"] == 2
    docs = json.loads((corpus_index / m["files"]["documents"]["name"]).read_text())
    assert docs["engine.md"]["origin"] == str(tmp_path / "corpus" / "engine.md")
