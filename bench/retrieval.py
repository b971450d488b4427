"""Retrieval benchmark: ingestion speed, vector-search latency and recall, and RAG prefix sharing.

    python bench/retrieval.py                      # everything (about 10 minutes on 2 idle cores)
    python bench/retrieval.py --sizes 100000 --rag-queries 60      # a quicker pass

1. Ingestion: the shipped corpus (workflows/corpus), replicated, chunked and embedded with the default
   embedder (all-MiniLM-L6-v2 on CPU): chunks per second for chunking, embedding and the whole build.
2. Vector search at 100k and 1M vectors of dimension 384 (MiniLM's), flat vs IVF vs HNSW: build time,
   single-query latency p50 / p99 and recall@10 against exact search. The vectors are synthetic: unit
   vectors around random cluster centres in a 64-dimensional subspace, plus a little noise in all 384
   dimensions (real sentence embeddings also have a low intrinsic dimension; uniform random vectors would
   make every approximate index look bad and clustered low-noise ones would make them look perfect).
3. RAG prefix sharing: a Zipf-skewed stream of questions over the corpus (popular documents are asked
   about far more often), k chunks retrieved per question, prompts rendered with fr.rag in stable order
   (by source and position) and in score order. For each order we count the prompt tokens that a prefix
   cache would serve, in whole 16-token blocks: first with the LLM tokenizer and an unbounded block-hash
   cache (exact, no engine needed), then, when flowrt.engine is importable, as the engine's own
   prefix_cache_hit_tokens on the default model (prompts sent one after another to a fresh engine per order).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CORPUS = ROOT / "workflows" / "corpus"
BLOCK = 16


def log(msg: str = "") -> None:
    print(msg, flush=True)


def pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs), q))


# ================================================================================= 1. ingestion
def bench_ingestion(copies: int) -> None:
    from flowrt.retrieval import Chunker, Document, Retriever, get_embedder, read_documents
    from flowrt.retrieval.chunking import hf_token_spans

    log(f"== ingestion: workflows/corpus x{copies}, default embedder (all-MiniLM-L6-v2), CPU ==")
    t0 = time.perf_counter()
    emb = get_embedder()
    _ = emb.model  # force the lazy model load so it is timed here
    log(f"embedder load           {time.perf_counter() - t0:6.1f} s (once per process)")
    base = read_documents([CORPUS])
    docs = [Document(source=f"copy{i}/{d.source}", text=d.text) for i in range(copies) for d in base]
    r = Retriever.create()
    chunker = Chunker(r.chunking, hf_token_spans(emb.tokenizer))
    t0 = time.perf_counter()
    chunks = [c for d in docs for c in chunker.chunk(d)]
    t_chunk = time.perf_counter() - t0
    t0 = time.perf_counter()
    r.add_documents(docs, progress=False)
    t_build = time.perf_counter() - t0
    mean_tokens = np.mean([len(hf_token_spans(emb.tokenizer)(c.text)) for c in chunks[: len(chunks) // copies]])
    log(f"documents / chunks      {len(docs)} / {len(chunks)} (mean {mean_tokens:.0f} tokens per chunk)")
    log(f"chunking                {len(chunks) / t_chunk:8.0f} chunks/s")
    log(f"build (chunk+embed+add) {len(chunks) / t_build:8.1f} chunks/s  ({t_build:.1f} s; embedding is ~all of it)")
    log()


# ================================================================================= 2. vectors
def synthetic(n: int, nq: int, d: int = 384, k: int = 64, clusters: int = 2000, noise: float = 0.8, seed: int = 0):
    rng = np.random.default_rng(seed)
    proj = np.linalg.qr(rng.standard_normal((d, k)))[0].T.astype(np.float32)
    centres = rng.standard_normal((clusters, k)).astype(np.float32)

    def gen(m: int) -> np.ndarray:
        z = centres[rng.integers(0, clusters, m)] + noise * rng.standard_normal((m, k), dtype=np.float32)
        x = z @ proj
        x += 0.05 * rng.standard_normal((m, d), dtype=np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        return x

    x = np.empty((n, d), np.float32)
    step = 100_000
    for i in range(0, n, step):
        x[i : i + step] = gen(min(step, n - i))
    return x, gen(nq)


def bench_vectors(n: int, nq: int, dim: int) -> list[tuple]:
    import faiss

    from flowrt.retrieval.index import VectorIndex

    log(f"-- {n:,} vectors, dim {dim}, {nq} single-vector queries --")
    t0 = time.perf_counter()
    x, q = synthetic(n, nq, d=dim)
    ids = np.arange(n, dtype=np.int64)
    log(f"data {time.perf_counter() - t0:.1f} s")
    big = n >= 500_000
    configs = [
        ("flat", {}),
        ("ivf", {"nlist": 1024} if big else {}),
        ("hnsw", {"hnsw_m": 16, "ef_construction": 40, "ef_search": 64} if big else {}),
    ]
    rows = []
    exact = None
    for kind, params in configs:
        gc.collect()
        t0 = time.perf_counter()
        idx = VectorIndex.create(dim, kind, **params)
        idx.add(x, ids)
        build = time.perf_counter() - t0
        idx.search(q[:5], 10)  # warm-up
        p = idx.params
        # One query at a time on one thread: a single query cannot use the OpenMP pool, and waking it
        # costs scheduler ticks on a busy machine.
        threads = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(1)
        # The saved default first, then a sweep of the search-time knob (no rebuild needed).
        sweep: list[dict] = [{}]
        if kind == "ivf":
            sweep += [{"nprobe": v} for v in (16, 2 * p.nprobe) if v != p.nprobe and v <= p.nlist]
        elif kind == "hnsw":
            sweep += [{"ef_search": v} for v in (128, 256) if v != p.ef_search]
        for knob in sweep:
            lat, found = [], []
            for i in range(nq):
                t0 = time.perf_counter()
                _, ids = idx.search(q[i : i + 1], 10, **knob)
                lat.append((time.perf_counter() - t0) * 1e3)
                found.append(ids[0])
            found = np.stack(found)
            if kind == "flat":
                exact = found
            recall = float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(exact, found)]))
            desc = {"flat": "exact",
                    "ivf": f"nlist={p.nlist} nprobe={knob.get('nprobe', p.nprobe)}",
                    "hnsw": f"M={p.hnsw_m} efC={p.ef_construction} efS={knob.get('ef_search', p.ef_search)}"}[kind]
            b = build if not knob else float("nan")
            rows.append((n, kind, desc, b, pct(lat, 50), pct(lat, 99), recall))
            log(f"{kind:5s} {desc:26s} build {b:7.1f} s   p50 {pct(lat, 50):7.3f} ms   p99 {pct(lat, 99):7.3f} ms   recall@10 {recall:.3f}")
        faiss.omp_set_num_threads(threads)
        del idx
    del x
    gc.collect()
    return rows


# ================================================================================= 3. RAG prefix sharing
def _sentences(text: str) -> list[str]:
    body = re.sub(r"```.*?```", " ", text, flags=re.S)
    body = re.sub(r"^#.*$", " ", body, flags=re.M)
    out = []
    for s in re.split(r"(?<=[.!?])\s+", body):
        s = " ".join(s.replace("`", "").split())
        if 6 <= len(s.split()) <= 40:
            out.append(s)
    return out


def zipf_workload(retriever, n: int, s: float = 1.1, seed: int = 0) -> list[str]:
    """n questions: a document drawn by Zipf popularity, then one of its sentences as the question."""
    from flowrt.retrieval import read_documents

    docs = {d.source: d.text for d in read_documents([CORPUS])}
    rng = np.random.default_rng(seed)
    order = rng.permutation(sorted(docs))  # popularity rank
    w = 1.0 / np.arange(1, len(order) + 1) ** s
    w /= w.sum()
    qs = []
    for src in rng.choice(order, size=n, p=w):
        sents = _sentences(docs[src])
        qs.append(sents[rng.integers(len(sents))])
    return qs


def block_hits(token_lists: list[list[int]]) -> tuple[int, int]:
    """Prompt tokens and tokens served from an unbounded prefix cache of 16-token block-hash chains."""
    cache: set[int] = set()
    total = hits = 0
    for toks in token_lists:
        total += len(toks)
        h, hit, chained = 0, 0, True
        for b in range(len(toks) // BLOCK):
            h = hash((h, tuple(toks[b * BLOCK : (b + 1) * BLOCK])))
            if chained and h in cache:
                hit += BLOCK
            else:
                chained = False
                cache.add(h)
        if hit == len(toks):  # the engine always computes the last prompt token
            hit -= BLOCK
        hits += hit
    return total, hits


def bench_rag(n_queries: int, k: int, use_engine: bool, engine_queries: int) -> None:
    from flowrt.retrieval import Retriever, rag

    log(f"== RAG prefix sharing: {n_queries} Zipf(1.1) questions over workflows/corpus, k={k} ==")
    r = Retriever.build(CORPUS, progress=False)
    qs = zipf_workload(r, n_queries)
    results = r.search_many_sync(qs, k=k)
    distinct_sets = len({tuple(sorted(c.id for c in cs)) for cs in results})
    log(f"{len(set(qs))} distinct questions, {distinct_sets} distinct top-{k} sets")
    prompts = {order: [rag(cs, q, order=order) for q, cs in zip(qs, results)] for order in ("stable", "score")}

    engine_ok, why = use_engine, ""
    if use_engine:
        try:
            from flowrt.engine import LLM, SamplingParams  # noqa: F401
        except Exception as e:  # pragma: no cover - depends on the checkout
            engine_ok, why = False, f"flowrt.engine not importable ({type(e).__name__}: {e})"
    tok = None
    if engine_ok:
        from flowrt.engine import LLM, SamplingParams

        t0 = time.perf_counter()
        llm = LLM(model=None)
        tok = llm.tokenizer
        log(f"default model loaded in {time.perf_counter() - t0:.1f} s")
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(ROOT / "tests" / "models" / "stories260K"))
        log(f"engine skipped: {why or '--no-engine'}; simulating with the stories260K tokenizer")

    log("tokenizer simulation (unbounded cache, whole 16-token blocks):")
    sim = {}
    for order, ps in prompts.items():
        total, hits = block_hits([tok(p)["input_ids"] for p in ps])
        sim[order] = (total, hits)
        log(f"  {order:6s} order: {hits:8,} of {total:8,} prompt tokens shared ({hits / total:6.1%})")
    log(f"  stable / score = {sim['stable'][1] / max(1, sim['score'][1]):.2f}x the cached tokens")

    if engine_ok:
        m = min(engine_queries, n_queries)
        log(f"engine (default model, first {m} questions, fresh engine per order, prompts one after another, max_tokens=1):")
        for order, ps in prompts.items():
            total, hits = block_hits([tok(p)["input_ids"] for p in ps[:m]])
            log(f"  simulated for these {m}: {order:6s} {hits:8,} of {total:8,} ({hits / total:6.1%})")
        params = SamplingParams(max_tokens=1, temperature=0.0)
        res = {}
        for order, ps in prompts.items():
            ps = ps[:m]
            llm = llm if order == "stable" else LLM(model=None)
            before = llm.stats()
            t0 = time.perf_counter()
            for p in ps:
                llm.generate([p], params)
            wall = time.perf_counter() - t0
            st = llm.stats()
            d = {key: st[key] - before.get(key, 0) for key in ("prompt_tokens", "prefix_cache_hit_tokens", "prefill_tokens_computed", "evictions")}
            res[order] = (d, wall)
            log(f"  {order:6s} order: prefix_cache_hit_tokens {d['prefix_cache_hit_tokens']:8,} of {d['prompt_tokens']:8,} "
                f"({d['prefix_cache_hit_tokens'] / d['prompt_tokens']:6.1%}), prefill computed {d['prefill_tokens_computed']:8,}, "
                f"evictions {d['evictions']}, {wall:6.1f} s")
            del llm
            gc.collect()
            llm = None
        s, c = res["stable"][0], res["score"][0]
        log(f"  stable / score: {s['prefix_cache_hit_tokens'] / max(1, c['prefix_cache_hit_tokens']):.2f}x the cache hits, "
            f"{c['prefill_tokens_computed'] / max(1, s['prefill_tokens_computed']):.2f}x less prefill computed "
            "(wall times above also depend on other load on the machine)")
    log()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copies", type=int, default=4, help="corpus copies for the ingestion figure")
    ap.add_argument("--sizes", default="100000,1000000", help="vector counts, comma-separated")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--queries", type=int, default=500, help="queries per size below 500k")
    ap.add_argument("--queries-large", type=int, default=100, help="queries per size from 500k up")
    ap.add_argument("--rag-queries", type=int, default=100)
    ap.add_argument("--engine-queries", type=int, default=40,
                    help="how many of the RAG questions also go through the engine (CPU prefill is the slow part)")
    ap.add_argument("-k", type=int, default=4, help="chunks per RAG prompt")
    ap.add_argument("--no-engine", action="store_true", help="RAG figure from the tokenizer only")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: ingestion,vectors,rag")
    ap.add_argument("--threads", type=int, default=None, help="FAISS OpenMP threads (default: FAISS's)")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    import faiss

    if args.threads:
        faiss.omp_set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sysinfo import banner

    log(banner(None, "retrieval (the engine part runs its auto dtype)"))
    log(f"flowrt retrieval bench: faiss {faiss.__version__} ({faiss.omp_get_max_threads()} threads), "
        f"{os.cpu_count()} CPUs, numpy {np.__version__}")
    t_all = time.perf_counter()
    if "ingestion" not in skip:
        bench_ingestion(args.copies)
    if "vectors" not in skip:
        log("== vector search (synthetic, see the module docstring) ==")
        rows = []
        for n in [int(s) for s in args.sizes.split(",") if s]:
            rows += bench_vectors(n, args.queries if n < 500_000 else args.queries_large, args.dim)
        log()
        log(f"{'vectors':>10} {'kind':5} {'params':26} {'build s':>8} {'p50 ms':>8} {'p99 ms':>8} {'recall@10':>9}")
        for n, kind, desc, build, p50, p99, rec in rows:
            b = f"{build:8.1f}" if build == build else f"{'':>8}"
            log(f"{n:>10,} {kind:5} {desc:26} {b} {p50:8.3f} {p99:8.3f} {rec:9.3f}")
        log()
    if "rag" not in skip:
        bench_rag(args.rag_queries, args.k, use_engine=not args.no_engine, engine_queries=args.engine_queries)
    log(f"total {time.perf_counter() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
