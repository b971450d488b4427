"""The ``flowrt`` command line (``flowrt run|resume|runs|serve|draw ...``): commands.py and the live
progress display (progress.py); the engine options it shares with the server are flowrt.runner.options."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """The console script's entry point (pyproject ``flowrt = "flowrt.cli:main"``); loads the CLI on call."""
    from .commands import main as _main

    return _main(argv)
