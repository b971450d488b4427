"""``flowrt ui --checkpoint runs.db``: the run viewer over a checkpoint store, at http://127.0.0.1:8001/ui.

It reads the store as ``flowrt runs`` does; answering an interrupt or forking a run from the page runs that run in
this process (its workflow loaded from the file it recorded, on the model and engine options it recorded, or those
given here), claimed as ``flowrt resume`` claims it. ``flowrt serve`` serves the same pages at /ui.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

_LOOPBACK = ("127.0.0.1", "::1", "localhost")
STOP_S = 3.0   # on Ctrl-C, how long open pages' event streams may stay before their connections are closed


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers ``ui`` on flowrt's CLI (an argparse subparsers object)."""
    from ..runner.options import add_engine_arguments

    p = subparsers.add_parser("ui", help="open the run viewer (a web page) over a checkpoint database",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", metavar="DB", required=True,
                   help="the SQLite database (or postgresql:// URL) the runs are checkpointed in")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8001, help="port to bind (default 8001; 0 picks a free one)")
    p.add_argument("--api-key", default=os.environ.get("FLOWRT_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on the viewer's API (default: $FLOWRT_API_KEY, else none)")
    p.add_argument("--index", metavar="DIR", help="retrieval index directory (default: the one each run recorded)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_arguments(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import CheckpointError, open_store

    try:
        store = open_store(args.checkpoint, create=False)
    except CheckpointError as e:
        print(f"flowrt ui: error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from ..runner.options import engine_kwargs_from_args
    from .api import standalone_app
    from .viewer import Viewer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.host not in _LOOPBACK:
        print(f"flowrt ui: binding {args.host}: the viewer is reachable from other machines"
              f"{'' if args.api_key else ' and no --api-key is set'}", file=sys.stderr)
    options = {**engine_kwargs_from_args(args), **({"model": args.model} if args.model else {}),
               **({"index": args.index} if args.index else {})}
    viewer = Viewer(lambda: store, runtime_options=options, api_key=args.api_key)
    config = uvicorn.Config(standalone_app(viewer), host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=STOP_S)
    server = uvicorn.Server(config)
    print(f"flowrt ui: http://{args.host}:{args.port}/ui (Ctrl-C stops)", file=sys.stderr)
    try:
        server.run()
    finally:
        store.close()
    return 0
