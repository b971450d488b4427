"""Serve a model (and optionally workflows) over HTTP with an OpenAI-compatible API.

The model runs in this process on flowrt's continuous-batching engine; any OpenAI client can use it
(base URL http://HOST:PORT/v1). Endpoints:

  POST /v1/completions                 text completions (streaming, n, logprobs, echo)
  POST /v1/chat/completions            chat through the model's chat template (streaming, n, logprobs)
  POST /v1/responses                   the Responses API (GET/DELETE /v1/responses/ID for stored ones)
  GET  /v1/models                      the served model name(s)
  POST /v1/workflows/NAME/runs         run a served workflow (--workflow); GET /v1/workflows lists them
  GET  /ui                             the run viewer over the workflows' runs (flowrt ui; its API behind --api-key)
  GET  /health                         200 when serving, 503 while shutting down
  GET  /metrics                        Prometheus metrics

SIGTERM or Ctrl-C drains: /health and new requests get 503, requests in flight get --graceful-timeout
seconds to finish, the rest end early (streams close with finish_reason "abort" and [DONE]), and the
process exits 0. A second signal exits at once (status 1).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from ..checkpoint.kv_budget import add_kv_budget
from .defaults import (DEFAULT_CHAT_TEMPLATE_TIMEOUT, DEFAULT_GRACEFUL_TIMEOUT, DEFAULT_MAX_BODY_BYTES,
                       DEFAULT_RESPONSES_MAX, DEFAULT_RESPONSES_MAX_BYTES)

logger = logging.getLogger("flowrt.server")

_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from flowrt.runner.options import add_engine_arguments  # --model and the engine's options, as `flowrt run`

    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: reachable from this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=os.environ.get("FLOWRT_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $FLOWRT_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients pass as `model` (default: the model's directory or file name)")
    p.add_argument("--workflow", action="extend", nargs="+", default=[], metavar="FILE",
                   help="workflow file(s) to serve; each workflow at POST /v1/workflows/NAME/runs, NAME being "
                        "its fr.Workflow(NAME)")
    p.add_argument("--index", metavar="DIR", help="retrieval index directory for served workflows (`retriever`)")
    p.add_argument("--checkpoint", metavar="DB", help="SQLite database or postgresql:// URL where served workflow runs "
                   "are checkpointed "
                   "(resumable after a restart; default: in memory, for this server's life)")
    p.add_argument("--checkpoint-kv", nargs="?", const=True, default=False, metavar="DIR",
                   help="save the KV blocks of live threads with every checkpoint (in DIR; default: beside the "
                        "--checkpoint SQLite database), so that a resumed run does not compute them again")
    p.add_argument("--no-cache", action="store_true",
                   help="run every step of served workflows: fr.Cache steps neither take nor keep results")
    add_kv_budget(p)
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="BYTES",
                   help="largest request body accepted; larger ones get 413 (default 16 MiB)")
    p.add_argument("--responses-max", type=int, default=DEFAULT_RESPONSES_MAX, metavar="N",
                   help="stored /v1/responses kept for GET and previous_response_id, oldest evicted "
                        "(default %(default)d)")
    p.add_argument("--responses-max-bytes", type=int, default=DEFAULT_RESPONSES_MAX_BYTES, metavar="BYTES",
                   help="bytes of stored responses kept, oldest evicted (default 256 MiB)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat template sent in a chat request (`chat_template`, "
                        "`chat_template_kwargs.chat_template`); off by default: a template is code the server "
                        "runs, so only enable this for trusted clients")
    p.add_argument("--chat-template-timeout", type=float, default=DEFAULT_CHAT_TEMPLATE_TIMEOUT, metavar="SECONDS",
                   help="longest a chat template may take to render; slower requests get 400 (default %(default)g)")
    p.add_argument("--graceful-timeout", type=float, default=DEFAULT_GRACEFUL_TIMEOUT, metavar="SECONDS",
                   help="on SIGTERM, how long in-flight requests get to finish before they are ended early "
                        "(default %(default)g)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server and access log verbosity (default info)")
    add_engine_arguments(p)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers `serve` on flowrt's CLI (an argparse subparsers object)."""
    p = subparsers.add_parser("serve", help="serve a model (and workflows) over an OpenAI-compatible HTTP API",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run, handler=run)
    return p


def run(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.host not in _LOOPBACK:
        logger.warning("binding %s: the server is reachable from other machines%s", args.host,
                       "" if args.api_key else " and no --api-key is set")

    from flowrt.runner.options import engine_kwargs_from_args
    from flowrt.engine import AsyncLLM, default_model_path

    from .app import create_app
    from .shutdown import STOP_FLUSH_SECONDS, DrainingServer
    from .workflows import load_workflows

    model_path = args.model if args.model is not None else str(default_model_path())
    try:
        workflows = load_workflows(args.workflow)
    except Exception as e:  # noqa: BLE001 - a bad workflow file is a usage error
        print(f"flowrt serve: {e}", file=sys.stderr)
        return 2
    try:
        if getattr(args, "replicas", None) or getattr(args, "ray_address", None):
            from flowrt.replicas.client import ReplicaSet, RouterClient  # the router is the server's engine

            engine = RouterClient(ReplicaSet(model_path, args.replicas or 1, ray_address=args.ray_address,
                                             routing=args.routing, **engine_kwargs_from_args(args)), owns=True)
        else:
            engine = AsyncLLM(model=model_path, **engine_kwargs_from_args(args))
    except (ValueError, OSError, RuntimeError, ImportError) as e:
        # bad engine options (pydantic names the field), missing model
        print(f"flowrt serve: cannot start the engine: {e}", file=sys.stderr)
        return 2
    try:
        runtime = None
        if workflows:
            from flowrt.checkpoint import CheckpointError
            from flowrt.runner.runtime import Runtime

            try:
                runtime = Runtime(model=engine, index=args.index, checkpoint=args.checkpoint or ":memory:",
                                  checkpoint_kv=args.checkpoint_kv, cache=not args.no_cache,
                                  checkpoint_kv_max_bytes=args.checkpoint_kv_max_bytes)
            except CheckpointError as e:   # a corrupt database, --checkpoint-kv without a place for blocks
                print(f"flowrt serve: error: {e}", file=sys.stderr)
                return 2
        app = create_app(engine, served_model_name=args.served_model_name, model_path=model_path,
                         api_key=args.api_key, max_body_bytes=args.max_body_bytes, workflows=workflows,
                         workflow_runtime=runtime, trust_request_chat_template=args.trust_request_chat_template,
                         chat_template_timeout=args.chat_template_timeout, responses_max=args.responses_max,
                         responses_max_bytes=args.responses_max_bytes)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="on",
                                timeout_graceful_shutdown=STOP_FLUSH_SECONDS)
        server = DrainingServer(config, app.state.flowrt, grace=args.graceful_timeout)
        server.run()
        if not server.started or server.forced:
            return 1
    finally:
        if runtime is not None:
            runtime.close()   # the KV blocks still queued for writing go to disk first
        engine.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flowrt serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
