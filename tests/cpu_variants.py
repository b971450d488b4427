"""Test helper: run the CPU kernels of one instruction-set variant, or skip saying why it cannot run here."""

from __future__ import annotations

import os
import shutil

import pytest

from flowrt.engine.cpu import build as cpu_build, ops as cpu_ops

HAVE_CXX = shutil.which(os.environ.get("CXX") or "g++") is not None
SUPPORTED = [i.name for i in cpu_build.supported()]


def cpu_variant(name: str):
    """cpu_ops.use_isa(name) as a context manager; skips without a compiler or where this CPU lacks the variant."""
    if not HAVE_CXX:
        pytest.skip("no C++ compiler here")
    if name not in SUPPORTED:
        missing = [f for f in cpu_build.get_isa(name).cpu if f not in cpu_build.cpu_flags()]
        pytest.skip(f"this CPU lacks {', '.join(missing)} (needed by the {name} variant)")
    return cpu_ops.use_isa(name)
