"""`flowrt index ...`: build, update, query and inspect retrieval indexes.

flowrt's CLI registers these with ``flowrt.retrieval.cli.add_parser(subparsers)``; each subcommand sets
``func`` (parsed args -> exit code). ``python -m flowrt.retrieval.cli index ...`` runs them standalone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

from .lock import DEFAULT_LOCK_TIMEOUT

__all__ = ["add_parser", "main"]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``index`` (with build / add / delete / query / info) on an argparse subparsers object."""
    p = subparsers.add_parser(
        "index",
        help="build, update, query and inspect document indexes for retrieval (RAG)",
        description="Build, update, query and inspect document indexes (flowrt.retrieval).",
    )
    sub = p.add_subparsers(dest="index_command", metavar="{build,add,delete,query,info}")
    sub.required = True
    p.set_defaults(func=lambda args: (p.print_help(sys.stderr), 2)[1])

    b = sub.add_parser("build", help="chunk, embed and index a directory of documents",
                       description="Chunk, embed and index every *.md, *.markdown, *.txt and *.rst file "
                                   "under DOCS_DIR.")
    b.add_argument("docs_dir", metavar="DOCS_DIR")
    b.add_argument("-o", "--output", required=True, metavar="INDEX_DIR", help="where to write the index (a directory)")
    b.add_argument("--chunk-tokens", type=int, default=192, metavar="N", help="maximum tokens per chunk (default 192)")
    b.add_argument("--overlap", type=int, default=32, metavar="M",
                   help="tokens shared by consecutive chunks (default 32)")
    b.add_argument("--kind", default="auto", choices=["auto", "flat", "ivf", "hnsw"],
                   help="flat: exact; ivf / hnsw: approximate, for large corpora; "
                        "auto: flat below 100k chunks, else hnsw")
    b.add_argument("--embedder", metavar="PATH", default=None,
                   help="local sentence-transformers / Hugging Face encoder directory "
                        "(default: bundled all-MiniLM-L6-v2)")
    b.add_argument("--nlist", type=int, default=None, help="IVF partitions (default about 4*sqrt(chunks))")
    b.add_argument("--nprobe", type=int, default=None, help="IVF partitions searched per query")
    b.add_argument("--hnsw-m", type=int, default=None, help="HNSW graph degree (default 32)")
    b.add_argument("--quiet", "-q", action="store_true", help="no progress bar or summary")
    _source_prefix(b)
    _lock_timeout(b)
    b.set_defaults(func=cmd_build)

    a = sub.add_parser(
        "add", help="add or update documents (files or directories) in an index",
        description="Add or update documents. A document's source id is its path relative to the index's root (the "
                    "directory it was built from), else relative to the directory holding every PATH outside it; a "
                    "file already indexed keeps its id. Prints one line per file: added, replaced or unchanged.")
    a.add_argument("index_dir", metavar="INDEX_DIR")
    a.add_argument("paths", nargs="+", metavar="PATH")
    a.add_argument("--quiet", "-q", action="store_true")
    _source_prefix(a)
    a.add_argument("--replace", action="store_true",
                   help="let a file replace a document indexed from another path (default: refuse)")
    _lock_timeout(a)
    a.set_defaults(func=cmd_add)

    d = sub.add_parser("delete", help="remove documents from an index by source (as `index info --sources` lists them)")
    d.add_argument("index_dir", metavar="INDEX_DIR")
    d.add_argument("sources", nargs="+", metavar="SOURCE")
    _lock_timeout(d)
    d.set_defaults(func=cmd_delete)

    q = sub.add_parser("query", help="search an index")
    q.add_argument("index_dir", metavar="INDEX_DIR")
    q.add_argument("question")
    q.add_argument("-k", type=int, default=5, help="number of chunks (default 5)")
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.add_argument("--nprobe", type=int, default=None, help="IVF: partitions searched (overrides the saved value)")
    q.add_argument("--ef-search", type=int, default=None, help="HNSW: search breadth (overrides the saved value)")
    q.set_defaults(func=cmd_query)

    i = sub.add_parser("info", help="describe an index (embedder, chunking, kind, sizes)")
    i.add_argument("index_dir", metavar="INDEX_DIR")
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.add_argument("--sources", action="store_true", help="also list every document source")
    i.set_defaults(func=cmd_info)
    return p


def _source_prefix(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source-prefix", metavar="NAME", default=None,
                   help="put NAME/ in front of every source id (to index files whose names clash with indexed ones)")


def _lock_timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lock-timeout", type=float, default=DEFAULT_LOCK_TIMEOUT, metavar="SECONDS",
                   help=f"how long to wait for another writer of the index (default {DEFAULT_LOCK_TIMEOUT:g})")


def _err(msg: str) -> None:
    print(f"flowrt index: error: {msg}", file=sys.stderr)


def _guard(fn):
    def run(args) -> int:
        from .errors import RetrievalError

        try:
            return fn(args)
        except (RetrievalError, ValueError, KeyError, FileNotFoundError) as e:
            _err(e.args[0] if isinstance(e, KeyError) and e.args else str(e))
            return 1

    run.__name__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


@_guard
def cmd_build(args) -> int:
    from .retriever import Retriever

    t0 = time.perf_counter()
    r = Retriever.build(
        args.docs_dir,
        args.output,
        embedder=args.embedder,
        chunk_tokens=args.chunk_tokens,
        overlap=args.overlap,
        kind=args.kind,
        progress=None if not args.quiet else False,
        nlist=args.nlist,
        nprobe=args.nprobe,
        hnsw_m=args.hnsw_m,
        source_prefix=args.source_prefix,
        lock_timeout=args.lock_timeout,
    )
    if not args.quiet:
        dt = time.perf_counter() - t0
        print(f"indexed {len(r.sources)} documents as {len(r)} chunks ({r.kind}, {r.embedder_name}) "
              f"in {dt:.1f}s -> {r.path}", file=sys.stderr)
    return 0


@_guard
def cmd_add(args) -> int:
    from .retriever import Retriever

    with Retriever.updating(args.index_dir, timeout=args.lock_timeout) as r:
        report = r.add(args.paths, source_prefix=args.source_prefix, replace=args.replace,
                       progress=None if not args.quiet else False)
        if report.added or report.replaced:
            r.save()
    if not args.quiet:
        for line in report.per_file():
            print(line, file=sys.stderr)
        print(f"{report} -> {r.path} ({len(r.sources)} documents, {len(r)} chunks)", file=sys.stderr)
    return 0


@_guard
def cmd_delete(args) -> int:
    from .retriever import Retriever

    with Retriever.updating(args.index_dir, timeout=args.lock_timeout) as r:
        n = r.delete(args.sources)
        r.save()
    print(f"removed {len(args.sources)} documents ({n} chunks) -> {r.path} ({len(r.sources)} documents left)",
          file=sys.stderr)
    return 0


@_guard
def cmd_query(args) -> int:
    from .retriever import Retriever

    r = Retriever.load(args.index_dir, nprobe=args.nprobe, ef_search=args.ef_search)
    _ = r.embedder.model  # load the model before timing the search
    t0 = time.perf_counter()
    hits = r.search_sync(args.question, k=args.k)
    ms = (time.perf_counter() - t0) * 1e3
    if args.json:
        result = {"query": args.question, "k": args.k, "results": [c.to_dict() for c in hits]}
        print(json.dumps(result, ensure_ascii=False))
        return 0
    _print_hits(args.question, hits, ms)
    return 0


def _print_hits(question: str, hits, ms: float) -> None:
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.panel import Panel
    except ImportError:  # pragma: no cover
        for rank, c in enumerate(hits, 1):
            print(f"{rank}. {c.score:.3f} [{c.source}] {c.heading}\n{c.text}\n")
        return
    con = Console()
    con.print(f"[bold]{escape(question)}[/]  ({len(hits)} results, {ms:.0f} ms)")
    for rank, c in enumerate(hits, 1):
        con.print(Panel(escape(c.text.strip()), title=escape(f"{rank}. [{c.source}] {c.heading}"),
                        subtitle=f"score {c.score:.3f}", title_align="left", subtitle_align="right"))


@_guard
def cmd_info(args) -> int:
    from .retriever import Retriever

    r = Retriever.load(args.index_dir, verify=False)
    info = r.info()
    if args.sources:
        info["sources"] = r.sources
    if args.json:
        print(json.dumps(info, ensure_ascii=False))
        return 0
    print(f"index        {info['path']}")
    print(f"documents    {info['documents']}")
    print(f"chunks       {info['chunks']}")
    idx = info["index"]
    extra = ", ".join(f"{k}={v}" for k, v in idx.items() if k not in ("kind", "ntotal"))
    print(f"kind         {idx['kind']}" + (f" ({extra})" if extra else ""))
    print(f"embedder     {info['embedder']['name']} (dim {info['embedder']['dim']})")
    print(f"chunking     {info['chunking']['chunk_tokens']} tokens, overlap {info['chunking']['overlap']}")
    print(f"format       v{info['format_version']}, generation {info['generation']}")
    if args.sources:
        for s in info["sources"]:
            print(f"  {s}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flowrt")
    sub = parser.add_subparsers(dest="command")
    sub.required = True
    add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
