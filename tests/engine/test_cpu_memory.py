"""engine/cpu_memory.py: the malloc thresholds that keep a step's activation memory mapped between steps. Each
check runs in a fresh interpreter (malloc's configuration is process-wide and set once)."""

import json
import os
import platform
import subprocess
import sys

import pytest

from support import STORIES

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc malloc only")

# Where a fresh 24 MiB tensor lives while allocated: mmapped blocks (hblkhd) or the heap (arena), per mallinfo2.
PROBE = r"""
import ctypes, json, sys
import torch
from flowrt.engine import cpu_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
tuned = cpu_memory.tune_malloc() if sys.argv[1] == "tune" else None
if sys.argv[1] == "engine":
    from flowrt.engine import LLM
    LLM(sys.argv[2], dtype="float32")
    tuned = cpu_memory._applied
before = libc.mallinfo2().hblkhd
x = torch.empty(6 * 2**20)
mapped = libc.mallinfo2().hblkhd - before
del x
print(json.dumps({"tuned": tuned, "again": cpu_memory.tune_malloc(), "mmapped": mapped}))
"""


def probe(*args, env=None):
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_untuned_malloc_maps_big_blocks_afresh():
    """The behaviour being fixed: glibc serves a first 24 MiB block with its own mmap (given back on free)."""
    assert probe("none")["mmapped"] >= 24 * 2**20


def test_tuned_malloc_serves_big_blocks_from_the_heap():
    r = probe("tune")
    assert r["tuned"] is True and r["again"] is True
    assert r["mmapped"] == 0


def test_opt_out():
    r = probe("tune", env={"FLOWRT_MALLOC_TUNE": "0"})
    assert r["tuned"] is False and r["mmapped"] >= 24 * 2**20


def test_a_cpu_engine_tunes_malloc():
    assert probe("engine", str(STORIES))["tuned"] is True
