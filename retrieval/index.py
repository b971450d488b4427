"""FAISS vector indexes over normalized embeddings (inner product = cosine similarity).

Kinds:
  ``flat``  exact search (``IndexFlatIP`` behind an id map). The default for small corpora.
  ``ivf``   ``IndexIVFFlat``: k-means partitions, searched ``nprobe`` at a time. Needs training data
            (the first batch of vectors); later additions go to the trained partitions.
  ``hnsw``  ``IndexHNSWFlat`` behind an id map: a proximity graph, no training. FAISS cannot remove
            from an HNSW graph, so a delete rebuilds the graph from the stored vectors.
  ``auto``  ``flat`` below ``AUTO_ANN_THRESHOLD`` vectors, ``hnsw`` at or above it.

Every vector carries a caller-chosen int64 id (the chunk id), so add and delete work by id.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["VectorIndex", "IndexParams", "KINDS", "AUTO_ANN_THRESHOLD"]

KINDS = ("flat", "ivf", "hnsw")
AUTO_ANN_THRESHOLD = 100_000


def _faiss():
    import faiss

    return faiss


@dataclass
class IndexParams:
    kind: str = "flat"
    nlist: int | None = None  #: IVF partitions (default: about 4 * sqrt(n), at least 39 points per partition)
    nprobe: int | None = None  #: IVF partitions searched per query (default: enough for ~0.95 recall@10)
    hnsw_m: int = 32  #: HNSW graph degree
    ef_construction: int = 80
    ef_search: int = 96

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind}
        if self.kind == "ivf":
            d.update(nlist=self.nlist, nprobe=self.nprobe)
        elif self.kind == "hnsw":
            d.update(hnsw_m=self.hnsw_m, ef_construction=self.ef_construction, ef_search=self.ef_search)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "IndexParams":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def resolve_kind(kind: str | None, n: int) -> str:
    kind = (kind or "auto").lower()
    if kind == "auto":
        return "hnsw" if n >= AUTO_ANN_THRESHOLD else "flat"
    if kind not in KINDS:
        raise ValueError(f"unknown index kind {kind!r}: choose one of auto, {', '.join(KINDS)}")
    return kind


class VectorIndex:
    """A FAISS index with int64 ids, add / remove / search, and (de)serialization to bytes."""

    def __init__(self, dim: int, params: IndexParams, faiss_index=None):
        self.dim = int(dim)
        self.params = params
        self._index = faiss_index
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(cls, dim: int, kind: str | None = "auto", *, n_hint: int = 0, **params) -> "VectorIndex":
        p = IndexParams(kind=resolve_kind(kind, n_hint), **{k: v for k, v in params.items() if v is not None})
        return cls(dim, p)

    def _new_faiss(self, train: np.ndarray | None):
        faiss = _faiss()
        d, p = self.dim, self.params
        if p.kind == "flat":
            return faiss.IndexIDMap2(faiss.IndexFlatIP(d))
        if p.kind == "hnsw":
            inner = faiss.IndexHNSWFlat(d, int(p.hnsw_m), faiss.METRIC_INNER_PRODUCT)
            inner.hnsw.efConstruction = int(p.ef_construction)
            inner.hnsw.efSearch = int(p.ef_search)
            return faiss.IndexIDMap2(inner)
        # ivf: trained on the first vectors it sees
        if train is None or len(train) == 0:
            raise ValueError("an IVF index is trained on its first vectors: add at least one")
        n = len(train)
        if not p.nlist:
            p.nlist = int(max(1, min(round(4 * math.sqrt(n)), n // 39 or 1)))
        p.nlist = int(min(p.nlist, n))
        if not p.nprobe:
            p.nprobe = int(max(1, min(p.nlist, round(p.nlist / 8))))
        quantizer = faiss.IndexFlatIP(d)
        index = faiss.IndexIVFFlat(quantizer, d, p.nlist, faiss.METRIC_INNER_PRODUCT)
        sample = train
        if n > 64 * p.nlist:  # 64 training points per centroid: enough for k-means, and fast at 1M vectors
            rng = np.random.default_rng(0)
            sample = train[np.sort(rng.choice(n, 64 * p.nlist, replace=False))]
        index.cp.seed = 1234
        index.train(np.ascontiguousarray(sample, dtype=np.float32))
        index.nprobe = p.nprobe
        return index

    # ------------------------------------------------------------------ properties
    @property
    def ntotal(self) -> int:
        return 0 if self._index is None else int(self._index.ntotal)

    def __len__(self) -> int:
        return self.ntotal

    @property
    def kind(self) -> str:
        return self.params.kind

    def _check(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim == 1:
            x = x[None, :]
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"expected vectors of dimension {self.dim}, got shape {tuple(x.shape)}")
        return x

    # ------------------------------------------------------------------ mutation
    def add(self, vectors: np.ndarray, ids: np.ndarray) -> None:
        x = self._check(vectors)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if len(ids) != len(x):
            raise ValueError(f"{len(x)} vectors but {len(ids)} ids")
        if len(x) == 0:
            return
        with self._lock:
            if self._index is None:
                self._index = self._new_faiss(x)
            self._index.add_with_ids(x, ids)

    def remove(self, ids) -> int:
        """Remove vectors by id; returns how many were removed."""
        ids = np.ascontiguousarray(np.asarray(list(ids), dtype=np.int64))
        if len(ids) == 0 or self._index is None:
            return 0
        faiss = _faiss()
        with self._lock:
            if self.kind != "hnsw":
                return int(self._index.remove_ids(faiss.IDSelectorBatch(ids)))
            all_ids = faiss.vector_to_array(self._index.id_map).astype(np.int64)
            keep = ~np.isin(all_ids, ids)
            removed = int((~keep).sum())
            if removed:
                vecs = self._index.index.reconstruct_n(0, len(all_ids))
                fresh = self._new_faiss(None)
                if keep.any():
                    fresh.add_with_ids(np.ascontiguousarray(vecs[keep]), np.ascontiguousarray(all_ids[keep]))
                self._index = fresh
            return removed

    def ids(self) -> np.ndarray:
        """All ids in the index (any order)."""
        if self._index is None:
            return np.zeros(0, dtype=np.int64)
        faiss = _faiss()
        with self._lock:
            if hasattr(self._index, "id_map"):
                return faiss.vector_to_array(self._index.id_map).astype(np.int64)
            inv = self._index.invlists
            out = [
                faiss.rev_swig_ptr(inv.get_ids(i), inv.list_size(i)).copy()
                for i in range(self._index.nlist)
                if inv.list_size(i)
            ]
            return np.concatenate(out).astype(np.int64) if out else np.zeros(0, dtype=np.int64)

    # ------------------------------------------------------------------ search
    def search(self, queries: np.ndarray, k: int, *, nprobe: int | None = None, ef_search: int | None = None):
        """(scores [nq, k'], ids [nq, k']) with k' = min(k, ntotal); missing hits have id -1."""
        q = self._check(queries)
        if self._index is None or self.ntotal == 0 or k <= 0:
            return np.zeros((len(q), 0), np.float32), np.zeros((len(q), 0), np.int64)
        k = min(int(k), self.ntotal)
        faiss = _faiss()
        params = None
        if self.kind == "ivf" and nprobe:
            params = faiss.SearchParametersIVF(nprobe=int(nprobe))
        elif self.kind == "hnsw" and ef_search:
            params = faiss.SearchParametersHNSW(efSearch=max(int(ef_search), k))
        elif self.kind == "hnsw" and self.params.ef_search < k:
            params = faiss.SearchParametersHNSW(efSearch=k)
        with self._lock:
            if params is None:
                scores, ids = self._index.search(q, k)
            else:
                scores, ids = self._index.search(q, k, params=params)
        return scores, ids

    # ------------------------------------------------------------------ serialization
    def write(self, path: str) -> None:
        with self._lock:
            _faiss().write_index(self._index if self._index is not None else self._new_empty(), path)

    def _new_empty(self):
        faiss = _faiss()
        if self.kind == "ivf":  # an untrained IVF cannot be written usefully; store an empty flat map
            return faiss.IndexIDMap2(faiss.IndexFlatIP(self.dim))
        return self._new_faiss(None)

    @classmethod
    def read(cls, path: str, params: IndexParams) -> "VectorIndex":
        faiss = _faiss()
        index = faiss.read_index(path)
        vi = cls(index.d, params, index)
        if index.ntotal == 0 and params.kind == "ivf":
            vi._index = None  # trained on the next add
        if params.kind == "ivf" and vi._index is not None and params.nprobe:
            faiss.extract_index_ivf(index).nprobe = int(params.nprobe)
        if params.kind == "hnsw":
            faiss.downcast_index(index.index).hnsw.efSearch = int(params.ef_search)
        return vi

    @staticmethod
    def describe(index) -> str:
        return type(index).__name__
