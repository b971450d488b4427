"""Approximate indexes (IVF, HNSW): recall against exact search, deletes, persistence. No embedding model."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

faiss = pytest.importorskip("faiss")

from flowrt.retrieval import Document, Retriever  # noqa: E402 - only once faiss is known to import
from flowrt.retrieval.index import VectorIndex, resolve_kind  # noqa: E402


@pytest.fixture()
def one_omp_thread():
    # The test machines have 2 shared cores; OpenMP spinning on an oversubscribed CPU only slows FAISS down.
    old = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(old)


def clustered(n: int, nq: int, d: int = 32, clusters: int = 1000, noise: float = 1.0, seed: int = 0):
    """Unit vectors around random cluster centres (noise as large as the centres: neighbours are not trivial)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, d)).astype(np.float32)
    x = centres[rng.integers(0, clusters, n)] + noise * rng.standard_normal((n, d)).astype(np.float32)
    q = centres[rng.integers(0, clusters, nq)] + noise * rng.standard_normal((nq, d)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    return x, q


def recall_at_k(exact: np.ndarray, approx: np.ndarray) -> float:
    k = exact.shape[1]
    return float(np.mean([len(set(a) & set(b)) / k for a, b in zip(exact, approx)]))


@pytest.mark.slow
def test_ivf_and_hnsw_recall_at_10_on_50k(one_omp_thread):
    x, q = clustered(50_000, 200)
    ids = np.arange(len(x), dtype=np.int64) * 7 + 3  # ids need not be positions
    flat = VectorIndex.create(32, "flat")
    flat.add(x, ids)
    _, exact = flat.search(q, 10)
    assert set(exact.ravel()) <= set(ids)

    ivf = VectorIndex.create(32, "ivf")
    ivf.add(x, ids)
    assert ivf.params.nlist > 100 and ivf.params.nprobe < ivf.params.nlist
    r_ivf = recall_at_k(exact, ivf.search(q, 10)[1])

    hnsw = VectorIndex.create(32, "hnsw", hnsw_m=16, ef_construction=40)
    hnsw.add(x, ids)
    r_hnsw = recall_at_k(exact, hnsw.search(q, 10)[1])
    assert r_ivf >= 0.95, r_ivf
    assert r_hnsw >= 0.95, r_hnsw


@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_remove_by_id(kind, one_omp_thread):
    x, q = clustered(3000, 20, d=16, clusters=50)
    ids = np.arange(3000, dtype=np.int64)
    idx = VectorIndex.create(16, kind)
    idx.add(x, ids)
    _, before = idx.search(x[:5], 1)
    assert list(before[:, 0]) == [0, 1, 2, 3, 4]  # each vector finds itself
    assert idx.remove([0, 1, 2, 99_999]) == 3
    assert idx.ntotal == 2997 and not {0, 1, 2} & set(idx.ids().tolist())
    _, after = idx.search(x[:5], 5)
    assert not {0, 1, 2} & set(after.ravel().tolist())
    assert after[3, 0] == 3 and after[4, 0] == 4


def test_auto_kind_by_size():
    assert resolve_kind("auto", 10) == "flat"
    assert resolve_kind("auto", 1_000_000) == "hnsw"
    with pytest.raises(ValueError, match="unknown index kind"):
        resolve_kind("lsh", 10)


class HashEmbedder:
    """A deterministic bag-of-words embedder (no model): enough to exercise the Retriever machinery."""

    name = "test/hash-bow-64"
    dim = 64
    tokenizer = None

    def encode(self, texts, progress=None):
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, t in enumerate(texts):
            for w in t.lower().split():
                h = int.from_bytes(hashlib.blake2b(w.strip(".,?!").encode(), digest_size=8).digest(), "little")
                out[i, h % self.dim] += 1.0 if (h >> 32) & 1 else -1.0
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)
        return out


def _docs(n: int) -> list[Document]:
    rng = np.random.default_rng(1)
    vocab = [f"w{i}" for i in range(400)]
    return [Document(source=f"doc{i:04d}.txt", text=" ".join(rng.choice(vocab, 12)) + f" marker{i}.") for i in range(n)]


@pytest.mark.parametrize("kind", ["ivf", "hnsw"])
def test_ann_retriever_persists_params_and_deletes(kind, tmp_path, one_omp_thread):
    emb = HashEmbedder()
    docs = _docs(600)
    r = Retriever.build(docs, tmp_path / "idx", embedder=emb, kind=kind, chunk_tokens=64, overlap=8)
    m = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert m["index"]["kind"] == kind and m["embedder"] == {"name": emb.name, "dim": 64}
    back = Retriever.load(tmp_path / "idx", embedder=emb)
    assert back.kind == kind and back.info()["index"] == r.info()["index"]
    q = docs[17].text
    assert back.search_sync(q, k=1)[0].source == "doc0017.txt"
    back.delete("doc0017.txt")
    back.add_documents([Document(source="late.txt", text="a late addition about marker17")])
    back.save()
    again = Retriever.load(tmp_path / "idx", embedder=emb, nprobe=8 if kind == "ivf" else None,
                           ef_search=128 if kind == "hnsw" else None)
    assert "doc0017.txt" not in again.sources and "late.txt" in again.sources
    assert all(c.source != "doc0017.txt" for c in again.search_sync(q, k=20))
    assert len(again) == 600
