"""flowrt.retrieval on real all-MiniLM-L6-v2 embeddings (offline) and the shipped corpus."""

from __future__ import annotations

import json
import os
from pathlib import Path

import anyio
import numpy as np
import pytest

pytest.importorskip("faiss")
pytest.importorskip("sentence_transformers")

import flowrt.retrieval as fr_retrieval
from flowrt.retrieval import (
    Chunk,
    Chunker,
    ChunkingConfig,
    Document,
    Embedder,
    EmbedderMismatchError,
    EmbedderNotFoundError,
    IndexLoadError,
    Retriever,
    get_embedder,
    rag,
)
from flowrt.retrieval.chunking import hf_token_spans
from support import retrieval_cli as _cli
from support import ROOT

CORPUS = ROOT / "workflows" / "corpus"

# 20 questions with the one corpus document that answers each (phrased as a user would ask, not copied).
KNOWN_ANSWERS = [
    ("How do I install flowrt and why is the model wheel installed without dependencies?", "installation.md"),
    ("Which model runs when I do not pass --model?", "default_model.md"),
    ("What is the shape of the per-layer KV pool and what is a block table?", "kv_cache.md"),
    ("How does a block hash identify a whole prefix, and which blocks get evicted first?", "prefix_caching.md"),
    ("What happens when a forked child writes into a partially filled shared block?", "copy_on_write.md"),
    ("How does continuous batching decide what goes into one engine step?", "scheduler.md"),
    ("Which sequence is preempted when KV blocks run out?", "preemption.md"),
    ("What is the slot mapping and where are logits computed?", "model_runner.md"),
    ("Does flowrt support Qwen3 and GGUF quantized weights?", "models.md"),
    ("How can the Triton kernels be tested on a machine without a GPU?", "kernels.md"),
    ("What does temperature 0 mean and which finish reasons exist?", "sampling_params.md"),
    ("How do I append text to a thread and generate a continuation?", "threads.md"),
    ("How does select choose between options like yes and no?", "fork_and_select.md"),
    ("Why must chat template rendering keep earlier turns byte-stable?", "chat.md"),
    ("What happens if my workflow graph has a cycle or an unknown parameter name?", "workflows.md"),
    ("How do I open a trace of a workflow run in Perfetto?", "tracing.md"),
    ("Which HTTP status does the server return for a wrong API key?", "server.md"),
    ("How do I publish a workflow as an HTTP endpoint and scrape Prometheus metrics?", "metrics.md"),
    ("When does the index switch from flat to HNSW, and what does the manifest record?", "indexes.md"),
    ("Why does fr.rag sort retrieved chunks by source instead of by score?", "rag.md"),
]


SLOW_FIXTURES = {"corpus_index"}  # builds the corpus index with the embedding model (tests/conftest.py)


@pytest.fixture(scope="session")
def corpus_index(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("retrieval") / "corpus-index"
    Retriever.build(CORPUS, out, progress=False)
    return out


@pytest.fixture(scope="session")
def corpus(corpus_index) -> Retriever:
    return Retriever.load(corpus_index)


def small_docs(tmp_path: Path) -> Path:
    d = tmp_path / "docs"
    d.mkdir()
    (d / "alpha.md").write_text("# Alpha\n\nAlpha particles are helium nuclei; a sheet of paper stops them.\n")
    (d / "bananas.txt").write_text("Bananas are yellow fruit.\n\nThey grow in hanging bunches on large plants.\n")
    (d / "rust.md").write_text("# Rust\n\nIron rusts when oxygen and water oxidize it into iron oxide.\n")
    return d


# ---------------------------------------------------------------------------------------------- embedder
def test_default_embedder_is_offline_normalized_and_cached():
    e = Embedder()
    assert e.name == "sentence-transformers/all-MiniLM-L6-v2"
    assert e.path.is_dir() and (e.path / "model.safetensors").is_file()
    v = e.encode(["flowrt shares KV blocks", "bananas are yellow"])
    assert v.shape == (2, 384) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert e.encode("one text").shape == (384,)
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    assert get_embedder().model is e.model  # one model per process
    assert get_embedder("default") is get_embedder(None)


def test_embedder_errors_name_the_problem(tmp_path):
    with pytest.raises(EmbedderNotFoundError, match="not a local directory"):
        Embedder("sentence-transformers/some-model-on-the-hub")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EmbedderNotFoundError, match="config.json"):
        Embedder(tmp_path / "empty")


# ---------------------------------------------------------------------------------------------- chunking
def test_chunking_respects_headings_paragraphs_and_token_budget():
    tok = get_embedder().tokenizer
    spans = hf_token_spans(tok)
    para = " ".join(f"Sentence number {i} talks about KV blocks and prefix caching." for i in range(30))
    text = (
        "# Guide\n\nIntro paragraph.\n\n## Part A\n\n" + para + "\n\n" + para
        + "\n\n```python\n# not a heading\nx = 1\n\ny = 2\n```\n\n## Part B\n\nShort tail.\n"
    )
    cfg = ChunkingConfig(chunk_tokens=64, overlap=16)
    chunks = Chunker(cfg, spans).chunk(Document(source="guide.md", text=text))
    assert [c.position for c in chunks] == list(range(len(chunks)))
    assert all(c.source == "guide.md" and c.title == "Guide" for c in chunks)
    headings = [c.heading for c in chunks]
    assert headings[0] == "Guide" and chunks[0].text == "Intro paragraph."
    assert headings[-1] == "Guide > Part B" and chunks[-1].text == "Short tail."
    assert "Guide > not a heading" not in headings  # '#' inside a code fence is not a heading
    for c in chunks:
        assert text[c.start : c.end] == c.text
        assert len(spans(c.text)) <= cfg.chunk_tokens
        assert "## Part" not in c.text  # never spans a heading
    part_a = [c for c in chunks if c.heading == "Guide > Part A"]
    assert len(part_a) >= 4
    # Consecutive chunks overlap, and every cut falls on a sentence or paragraph boundary.
    for a, b in zip(part_a, part_a[1:]):
        assert b.start < a.end, "consecutive chunks should overlap"
        assert a.text.rstrip().endswith((".", "```")) or a.text.rstrip().endswith("2")
        assert b.text[0].isupper() or b.text.startswith("```")
    assert any("```python" in c.text and "y = 2" in c.text for c in chunks), "a code fence stays in one chunk"


def test_chunking_config_validation():
    with pytest.raises(ValueError, match="overlap"):
        ChunkingConfig(chunk_tokens=64, overlap=64)
    with pytest.raises(ValueError, match="chunk_tokens"):
        ChunkingConfig(chunk_tokens=0)
    r = Retriever.create(chunk_tokens=1000, overlap=10)
    with pytest.raises(ValueError, match="maximum sequence length"):
        r.add_texts(["some text"])


# ---------------------------------------------------------------------------------------------- search quality
def test_corpus_top3_recall(corpus):
    assert len(corpus.sources) >= 30
    results = corpus.search_many_sync([q for q, _ in KNOWN_ANSWERS], k=3)
    hits = [doc in [c.source for c in cs] for (_, doc), cs in zip(KNOWN_ANSWERS, results)]
    misses = [q for (q, _), h in zip(KNOWN_ANSWERS, hits) if not h]
    assert sum(hits) / len(hits) >= 0.9, f"top-3 recall {sum(hits)}/{len(hits)}; missed: {misses}"
    for cs in results:
        assert [c.score for c in cs] == sorted((c.score for c in cs), reverse=True)
        assert all(isinstance(c, Chunk) and c.text and c.heading for c in cs)


def test_async_search_matches_sync(corpus):
    q = "How are KV blocks shared between forks?"

    async def main():
        return await corpus.search(q, k=4)

    got = anyio.run(main)
    want = corpus.search_sync(q, k=4)
    assert [(c.id, round(c.score, 5)) for c in got] == [(c.id, round(c.score, 5)) for c in want]
    assert got[0].source == "copy_on_write.md"


def test_save_load_round_trip(corpus, corpus_index, tmp_path):
    again = Retriever.load(corpus_index)
    assert again.sources == corpus.sources and len(again) == len(corpus)
    q = [q for q, _ in KNOWN_ANSWERS[:5]]
    a, b = corpus.search_many_sync(q, k=4), again.search_many_sync(q, k=4)
    def rows(results):
        return [[(c.id, c.text, round(c.score, 5)) for c in x] for x in results]

    assert rows(a) == rows(b)
    m = json.loads((corpus_index / "manifest.json").read_text())
    assert m["embedder"] == {"name": "sentence-transformers/all-MiniLM-L6-v2", "dim": 384}
    assert m["chunking"]["chunk_tokens"] == 192 and m["chunking"]["overlap"] == 32
    assert m["index"]["kind"] == "flat" and m["format_version"] == fr_retrieval.FORMAT_VERSION
    # Saving a loaded index elsewhere and reloading gives the same thing.
    copy = again.save(tmp_path / "copy")
    assert Retriever.load(copy).info()["chunks"] == len(corpus)


def test_k_larger_than_index_and_bad_queries(tmp_path):
    r = Retriever.build(small_docs(tmp_path), progress=False)
    assert len(r.search_sync("fruit", k=50)) == len(r) == 3
    with pytest.raises(ValueError, match="k must be"):
        r.search_sync("fruit", k=0)
    with pytest.raises(TypeError):
        r.search_sync(42)
    assert Retriever.create().search_sync("anything") == []


# ---------------------------------------------------------------------------------------------- incremental
@pytest.mark.slow
def test_incremental_add_update_delete(tmp_path):
    docs = small_docs(tmp_path)
    out = tmp_path / "idx"
    r = Retriever.build(docs, out, progress=False)
    assert r.sources == ["alpha.md", "bananas.txt", "rust.md"]
    assert r.search_sync("what stops helium nuclei?", k=1)[0].source == "alpha.md"

    extra = tmp_path / "more"
    extra.mkdir()
    (extra / "volcano.md").write_text("# Volcanoes\n\nA volcano erupts when magma rises through the crust.\n")
    rep = r.add([extra])
    assert rep.added == ["volcano.md"] and rep.chunks == 1
    assert r.search_sync("magma eruption", k=1)[0].source == "volcano.md"

    # Same text again: skipped. Changed text: replaced (old chunks gone).
    (docs / "rust.md").write_text("# Rust\n\nRust is also a programming language with a borrow checker.\n")
    rep = r.add([docs])
    assert rep.unchanged == ["alpha.md", "bananas.txt"] and rep.replaced == ["rust.md"] and not rep.added
    assert all("oxygen" not in c.text for c in r.chunks())
    assert r.search_sync("borrow checker", k=1)[0].source == "rust.md"

    assert r.delete(["bananas.txt"]) == 1
    assert "bananas.txt" not in r.sources
    assert all(c.source != "bananas.txt" for c in r.search_sync("yellow fruit", k=10))
    with pytest.raises(KeyError, match="not in the index"):
        r.delete("nope.md")
    r.save()
    back = Retriever.load(out)
    assert back.sources == ["alpha.md", "rust.md", "volcano.md"]
    assert back.search_sync("magma", k=1)[0].source == "volcano.md"
    ids = [c.id for c in back.chunks()]
    assert len(set(ids)) == len(ids)


# ---------------------------------------------------------------------------------------------- load errors
@pytest.fixture()
def small_index(tmp_path) -> Path:
    out = tmp_path / "idx"
    Retriever.build(small_docs(tmp_path), out, progress=False)
    return out


def _manifest(p: Path) -> dict:
    return json.loads((p / "manifest.json").read_text())


def _write_manifest(p: Path, m: dict) -> None:
    (p / "manifest.json").write_text(json.dumps(m))


def test_load_missing_and_not_an_index(tmp_path):
    with pytest.raises(fr_retrieval.IndexNotFoundError, match="does not exist"):
        Retriever.load(tmp_path / "nowhere")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("hi")
    with pytest.raises(fr_retrieval.IndexNotFoundError, match="manifest.json is missing"):
        Retriever.load(tmp_path / "plain")
    with pytest.raises(fr_retrieval.IndexNotFoundError, match="is a file"):
        Retriever.load(tmp_path / "plain" / "notes.txt")
    # And saving over a non-index directory is refused.
    with pytest.raises(fr_retrieval.RetrievalError, match="refusing"):
        Retriever.create().save(tmp_path / "plain")


def test_load_newer_format(small_index):
    m = _manifest(small_index)
    m["format_version"] = fr_retrieval.FORMAT_VERSION + 1
    m["created_by"] = "flowrt 9.0"
    _write_manifest(small_index, m)
    v = fr_retrieval.FORMAT_VERSION
    with pytest.raises(fr_retrieval.IndexVersionError, match=rf"format version {v + 1}.*flowrt 9\.0.*up to {v}"):
        Retriever.load(small_index)


def test_load_corrupt_manifest(small_index):
    text = (small_index / "manifest.json").read_text()
    (small_index / "manifest.json").write_text(text[: len(text) // 2])
    with pytest.raises(fr_retrieval.IndexCorruptError, match="not valid JSON"):
        Retriever.load(small_index)


def test_load_truncated_index_file(small_index):
    f = small_index / _manifest(small_index)["files"]["index"]["name"]
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(fr_retrieval.IndexCorruptError, match="truncated"):
        Retriever.load(small_index)


def test_load_corrupt_doc_store_same_size(small_index):
    f = small_index / _manifest(small_index)["files"]["chunks"]["name"]
    data = bytearray(f.read_bytes())
    i = data.index(b"helium")
    data[i : i + 6] = b"HELIUM"  # same size, different bytes: only the checksum can tell
    f.write_bytes(bytes(data))
    with pytest.raises(fr_retrieval.IndexCorruptError, match="sha256"):
        Retriever.load(small_index)


def test_load_missing_data_file(small_index):
    (small_index / _manifest(small_index)["files"]["documents"]["name"]).unlink()
    with pytest.raises(fr_retrieval.IndexCorruptError, match="missing"):
        Retriever.load(small_index)


def test_load_dimension_mismatch(small_index):
    m = _manifest(small_index)
    m["embedder"]["dim"] = 768
    _write_manifest(small_index, m)
    with pytest.raises(fr_retrieval.DimensionMismatchError, match="dimension 384.*768"):
        Retriever.load(small_index)


def test_load_different_embedder(small_index):
    # A different local model directory (this one is a causal LM, but the name alone already differs).
    other = ROOT / "tests" / "models" / "stories260K"
    with pytest.raises(EmbedderMismatchError, match="all-MiniLM-L6-v2"):
        Retriever.load(small_index, embedder=str(other))
    # The same model named another way is fine.
    assert len(Retriever.load(small_index, embedder="default")) == 3

    class Fake:
        name = "sentence-transformers/all-MiniLM-L6-v2"
        dim = 128

    with pytest.raises(fr_retrieval.DimensionMismatchError, match="128"):
        Retriever.load(small_index, embedder=Fake())


def test_load_embedder_not_available(small_index):
    m = _manifest(small_index)
    m["embedder"]["name"] = "/models/gone-encoder"
    _write_manifest(small_index, m)
    r = Retriever.load(small_index)  # loading the index itself needs no model
    with pytest.raises(EmbedderNotFoundError, match="gone-encoder.*--embedder"):
        r.search_sync("anything")


def test_every_load_error_is_an_index_load_error():
    for cls in (fr_retrieval.IndexNotFoundError, fr_retrieval.IndexCorruptError, fr_retrieval.IndexVersionError,
                EmbedderMismatchError, fr_retrieval.DimensionMismatchError):
        assert issubclass(cls, IndexLoadError)


# ---------------------------------------------------------------------------------------------- atomic save
def test_interrupted_save_leaves_previous_index_loadable(small_index, tmp_path, monkeypatch):
    import flowrt.retrieval.retriever as rmod

    before = Retriever.load(small_index)
    want = [(c.id, c.source) for c in before.search_sync("helium", k=3)]
    files_before = sorted(p.name for p in small_index.iterdir())

    r = Retriever.load(small_index)
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "new.md").write_text("# New\n\nHelium balloons float because helium is lighter than air.\n")
    r.add([extra])

    real = rmod._write_bytes
    calls = {"n": 0}

    def crash_midway(path, data):
        calls["n"] += 1
        if calls["n"] == 2:  # the document table: write half of it, then "lose power"
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
            raise KeyboardInterrupt("simulated crash during save")
        return real(path, data)

    monkeypatch.setattr(rmod, "_write_bytes", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        r.save()
    monkeypatch.setattr(rmod, "_write_bytes", real)

    after = Retriever.load(small_index)  # the previous generation, intact
    assert after.sources == before.sources
    assert [(c.id, c.source) for c in after.search_sync("helium", k=3)] == want
    assert len(list(small_index.iterdir())) > len(files_before)  # the half-written files are there...
    r.save()  # ...and the next successful save commits the new generation and sweeps them
    final = Retriever.load(small_index)
    assert "new.md" in final.sources
    assert len(list(small_index.iterdir())) == 4  # manifest + one generation of 3 files


def test_interrupted_first_save_leaves_nothing(tmp_path, monkeypatch):
    import flowrt.retrieval.retriever as rmod

    r = Retriever.build(small_docs(tmp_path), progress=False)

    def boom(path, data):
        raise OSError("disk full")

    monkeypatch.setattr(rmod, "_write_bytes", boom)
    with pytest.raises(OSError, match="disk full"):
        r.save(tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".fresh")]


# ---------------------------------------------------------------------------------------------- rag()
def _chunk(source, pos, score, text=None):
    return Chunk(text=text or f"text of {source} part {pos}", source=source, position=pos,
                 heading=source.split(".")[0], score=score)


def test_rag_order_is_stable_not_by_score():
    a, b, c, d = _chunk("a.md", 0, 0.9), _chunk("b.md", 1, 0.8), _chunk("b.md", 0, 0.7), _chunk("c.md", 2, 0.6)
    p1 = rag([a, b, c, d], "Q1?")
    p2 = rag([d, c, a, b], "Q1?")
    assert p1 == p2
    assert p1.index("[a.md]") < p1.index("b.md part 0") < p1.index("b.md part 1") < p1.index("[c.md]")
    assert p1.rstrip().endswith("Question: Q1?\nAnswer:")
    assert "0.9" not in p1  # scores never reach the prompt
    # Two queries with overlapping results share everything up to the first differing chunk...
    e = _chunk("d.md", 0, 0.95)
    q1, q2 = rag([b, a, d], "first question"), rag([e, a, b], "second question")
    common = os.path.commonprefix([q1, q2])
    assert "b.md part 1" in common
    # ...while score order shares nothing past the instructions.
    s1, s2 = rag([b, a, d], "first question", order="score"), rag([e, a, b], "second question", order="score")
    assert len(os.path.commonprefix([s1, s2])) < len(common)


def test_rag_without_question_dicts_dedupe_and_budget():
    chunks = [_chunk("x.md", 0, 0.5), _chunk("x.md", 0, 0.5), _chunk("w.md", 3, 0.1).to_dict()]
    ctx = rag(chunks)
    assert ctx.count("[x.md]") == 1 and ctx.index("[w.md]") < ctx.index("[x.md]")
    assert "Question:" not in ctx and ctx.endswith("text of x.md part 0")
    big = [_chunk(f"s{i}.md", 0, 1.0 - i / 10, text="word " * 50) for i in range(5)]
    words = lambda s: len(s.split())  # noqa: E731
    full = rag(big, "q")
    limited = rag(big, "q", max_tokens=words(full) - 60, count_tokens=words)
    assert words(limited) <= words(full) - 60
    assert "[s4.md]" not in limited and "[s0.md]" in limited  # the lowest-scored chunk goes first
    tiny = rag(big, "q", max_tokens=60, count_tokens=words)
    assert words(tiny) <= 60 and "[s0.md]" in tiny
    with pytest.raises(ValueError, match="context"):
        rag(big, "q", template="no placeholder")


def test_rag_on_real_results_shares_prefix(corpus):
    q1 = "How does the prefix cache evict blocks?"
    q2 = "What does a block hash cover in prefix caching?"
    r1, r2 = corpus.search_sync(q1, k=4), corpus.search_sync(q2, k=4)
    shared = {c.id for c in r1} & {c.id for c in r2}
    assert shared
    p1, p2 = rag(r1, q1), rag(r2, q2)
    assert rag(list(reversed(r1)), q1) == p1
    by_score = [rag(r1, q1, order="score"), rag(r2, q2, order="score")]
    assert len(os.path.commonprefix([p1, p2])) >= len(os.path.commonprefix(by_score))


# ---------------------------------------------------------------------------------------------- CLI
@pytest.mark.slow
def test_cli_build_add_query_info_delete(tmp_path, capsys):
    docs = small_docs(tmp_path)
    idx = tmp_path / "cli-idx"
    assert _cli("index", "build", docs, "-o", idx, "--chunk-tokens", "64", "--overlap", "8",
                "--kind", "flat", "-q") == 0
    capsys.readouterr()
    assert _cli("index", "query", idx, "what stops alpha particles", "-k", "2", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert out["results"][0]["source"] == "alpha.md" and len(out["results"]) == 2
    assert {"text", "source", "score", "position", "heading"} <= set(out["results"][0])

    more = tmp_path / "more"
    more.mkdir()
    (more / "tea.md").write_text("# Tea\n\nGreen tea is steamed or pan-fired soon after picking.\n")
    assert _cli("index", "add", idx, more / "tea.md") == 0
    assert _cli("index", "info", idx, "--json", "--sources") == 0
    info = json.loads(capsys.readouterr().out)
    assert info["documents"] == 4 and "tea.md" in info["sources"]
    assert info["chunking"] == {"chunk_tokens": 64, "overlap": 8} and info["index"]["kind"] == "flat"

    assert _cli("index", "delete", idx, "tea.md") == 0
    assert _cli("index", "info", idx) == 0
    text = capsys.readouterr().out
    assert "documents    3" in text and "all-MiniLM-L6-v2" in text

    assert _cli("index", "query", idx, "tea") == 0  # the human-readable form
    assert "[" in capsys.readouterr().out

    # Errors: a message on stderr and exit code 1, no traceback.
    assert _cli("index", "query", tmp_path / "missing", "x") == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err
    assert _cli("index", "delete", idx, "nope.md") == 1
    assert "not in the index" in capsys.readouterr().err
    assert _cli("index", "build", tmp_path / "more" / "..", "-o", tmp_path / "x", "--overlap", "500", "-q") == 1
    assert "overlap" in capsys.readouterr().err


def test_embedding_releases_its_threads_openmp_team(monkeypatch):
    """Embedding in a worker thread (Retriever.search runs there) leaves no OpenMP team behind, which would slow an
    engine's decode steps in the same process (engine/cpu/threads.py release_openmp_team)."""
    import threading

    from flowrt.engine.cpu import threads as cpu_threads

    calls: list[int] = []
    monkeypatch.setattr(cpu_threads, "release_openmp_team", lambda: calls.append(threading.get_ident()) or True)
    t = threading.Thread(target=lambda: get_embedder().encode(["a query", "another one"]))
    t.start()
    t.join()
    assert calls == [t.ident]
