"""flowrt.retrieval: embedders, chunking, persistent FAISS indexes, and prefix-friendly RAG context.

```python
from flowrt.retrieval import Retriever, rag
r = Retriever.build("workflows/corpus", "index/")     # or: Retriever.load("index/")
chunks = r.search_sync("How does prefix caching work?", k=4)   # await r.search(...) in async code
prompt = rag(chunks, "How does prefix caching work?")
with Retriever.updating("index/") as w:            # a writer: under the index's lock, on its latest generation
    print("\n".join(w.add(["more-docs/"]).per_file())); w.save()
```

Heavy dependencies (faiss, sentence-transformers, torch) are imported only when first used.
"""

from .chunking import Chunk, Chunker, ChunkingConfig, Document
from .citations import cited_sources
from .context import DEFAULT_CHUNK_TEMPLATE, DEFAULT_TEMPLATE, order_chunks, rag
from .embedder import DEFAULT_EMBEDDER, Embedder, default_embedder_path, get_embedder
from .errors import (
    DimensionMismatchError,
    EmbedderMismatchError,
    EmbedderNotFoundError,
    IndexConflictError,
    IndexCorruptError,
    IndexLoadError,
    IndexLockedError,
    IndexNotFoundError,
    IndexVersionError,
    RetrievalError,
    SourceConflictError,
)
from .index import IndexParams, VectorIndex
from .lock import IndexLock
from .retriever import FORMAT_VERSION, AddReport, Retriever
from .sources import read_documents

__all__ = [
    "Retriever",
    "Chunk",
    "rag",
    "order_chunks",
    "cited_sources",
    "Embedder",
    "get_embedder",
    "default_embedder_path",
    "DEFAULT_EMBEDDER",
    "Chunker",
    "ChunkingConfig",
    "Document",
    "read_documents",
    "VectorIndex",
    "IndexParams",
    "IndexLock",
    "AddReport",
    "FORMAT_VERSION",
    "DEFAULT_TEMPLATE",
    "DEFAULT_CHUNK_TEMPLATE",
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
