"""``flowrt serve``: the OpenAI-compatible server from the command line.

flowrt's CLI registers the subcommand with ``add_parser(subparsers)``; ``python -m flowrt.server`` runs it
on its own. SIGTERM (or Ctrl-C) shuts down gracefully: new connections are refused, in-flight requests
get ``--graceful-timeout`` seconds to finish, the rest are aborted, and the process exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Any, Iterator

logger = logging.getLogger("flowrt.server")

_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from flowrt.cli import add_engine_arguments  # --model and the engine's options, shared with `flowrt run`

    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: reachable from this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=os.environ.get("FLOWRT_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $FLOWRT_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients pass as `model` (default: the model's directory or file name)")
    p.add_argument("--workflow", action="extend", nargs="+", default=[], metavar="FILE",
                   help="workflow file(s) to serve at POST /v1/workflows/{name}/runs")
    p.add_argument("--index", metavar="DIR", help="retrieval index directory for served workflows (`retriever`)")
    p.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024,
                   help="largest request body accepted; larger ones get 413 (default 16 MiB)")
    p.add_argument("--graceful-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM before they are aborted (default 30)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_arguments(p)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers `serve` on flowrt's CLI (an argparse subparsers object)."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server over the in-process engine",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run, handler=run)
    return p


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that a SIGTERM/SIGINT it handled ends the process with status 0 instead
        of being re-raised, and /health turns 503 as soon as shutdown starts."""

        on_exit_signal: Any = None

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.on_exit_signal is not None:
                self.on_exit_signal()
            super().handle_exit(sig, frame)

    return Server


def run(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.host not in _LOOPBACK:
        logger.warning("binding %s: the server is reachable from other machines%s", args.host,
                       "" if args.api_key else " and no --api-key is set")

    from flowrt.cli import engine_kwargs_from_args
    from flowrt.engine import AsyncLLM, default_model_path

    from .app import create_app
    from .workflows import load_workflows

    model_path = args.model if args.model is not None else str(default_model_path())
    try:
        workflows = load_workflows(args.workflow)
    except Exception as e:  # noqa: BLE001 - a bad workflow file is a usage error
        print(f"flowrt serve: {e}", file=sys.stderr)
        return 2
    try:
        engine = AsyncLLM(model=model_path, **engine_kwargs_from_args(args))
    except (ValueError, OSError) as e:  # bad engine options (pydantic names the field), missing model
        print(f"flowrt serve: cannot start the engine: {e}", file=sys.stderr)
        return 2
    try:
        runtime = None
        if workflows:
            from flowrt.runtime import Runtime

            runtime = Runtime(model=engine, index=args.index)
        app = create_app(engine, served_model_name=args.served_model_name, model_path=model_path,
                         api_key=args.api_key, max_body_bytes=args.max_body_bytes, workflows=workflows,
                         workflow_runtime=runtime)
        st = app.state.flowrt
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="on",
                                timeout_graceful_shutdown=args.graceful_timeout)
        server = _server_class()(config)

        def on_exit_signal() -> None:
            st.shutting_down = True

        server.on_exit_signal = on_exit_signal
        server.run()
        if not server.started:
            return 1
    finally:
        engine.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flowrt serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
