"""The ``flowrt`` command line (``flowrt run|resume|runs|serve|draw ...``): commands.py, its options shared with
the server (options.py) and the live progress display (progress.py)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """The console script's entry point (pyproject ``flowrt = "flowrt.cli:main"``); loads the CLI on call."""
    from .commands import main as _main

    return _main(argv)
