"""Command-line options the front ends share (``flowrt run``/``resume`` and ``flowrt serve``): ``--model``,
the engine's options (built by ``flowrt.engine.cli_args`` from ``EngineArgs``' fields) and the replicas'.

Importing the engine loads torch, so on a parser that can defer (the ``flowrt`` CLI's ``defer_engine_options``)
the engine's options are added when the parser is first used: building the CLI does not load the engine.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_engine_arguments", "engine_kwargs_from_args", "replica_kwargs_from_args"]

ENGINE_GROUP_DESCRIPTION = ("the fields of flowrt.engine.EngineArgs (engine/API.md); an option left out keeps the "
                            "engine's default")


def _add_engine_options(group: Any) -> None:
    from ..engine.cli_args import add_cli_args

    add_cli_args(group)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """``--model``, one ``--kebab-case`` option per ``EngineArgs`` field, and the replica options (read back
    with ``engine_kwargs_from_args`` and ``replica_kwargs_from_args``)."""
    g = p.add_argument_group("engine", ENGINE_GROUP_DESCRIPTION)
    g.add_argument("--model", metavar="PATH", default=None,
                   help="Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    defer = getattr(p, "defer_engine_options", None)  # duck-typed: `python -m flowrt.cli` has two _Parser classes
    if defer is not None:
        defer(lambda: _add_engine_options(g))
    else:
        _add_engine_options(g)
    r = p.add_argument_group("replicas", "scale out: engine replicas as Ray actors (needs `pip install 'flowrt[ray]'`)")
    r.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="run N engine replicas as Ray actors on a local Ray instance; each workflow run stays on "
                        "one replica, new runs go where their prefix is cached")
    r.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="join this Ray cluster (e.g. auto, ray://host:10001) instead of starting one")
    r.add_argument("--routing", choices=["prefix", "round_robin"], default="prefix",
                   help="how new runs pick a replica (default: prefix, with a load fallback)")


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineArgs`` keywords given on the command line (options left out are not included)."""
    from ..engine.cli_args import engine_kwargs_from_args as from_args

    return from_args(args)


def replica_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """``fr.Runtime`` keywords for ``--replicas`` / ``--ray-address`` / ``--routing`` (empty without them)."""
    if not getattr(args, "replicas", None) and not getattr(args, "ray_address", None):
        return {}
    return {"replicas": args.replicas, "ray_address": args.ray_address, "routing": args.routing}
