"""The shipped CPU kernel source compiles wherever a C++ compiler is present. The kernel tests skip, and the engine
falls back to torch, when the kernels are unavailable, so without this check a source that no longer compiles would
pass the suite unnoticed."""

import os
import shutil

import pytest

from flowrt.engine.cpu import ops as cpu_ops


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(os.environ.get("CXX") or "g++") is None, reason="no C++ compiler here")
def test_kernel_source_compiles(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWRT_CACHE_DIR", str(tmp_path))
    so = cpu_ops.build(force=True)  # raises RuntimeError with the compiler's message
    assert so.is_file() and so.parent == tmp_path / "cpu_ops"
