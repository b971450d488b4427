"""engine/cpu/memory.py: the malloc thresholds that keep a step's activation memory mapped between steps. Each
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
from flowrt.engine.cpu import memory as cpu_memory
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


@pytest.mark.slow
def test_untuned_malloc_maps_big_blocks_afresh():
    """The behaviour being fixed: glibc serves a first 24 MiB block with its own mmap (given back on free)."""
    assert probe("none")["mmapped"] >= 24 * 2**20


@pytest.mark.slow
def test_tuned_malloc_serves_big_blocks_from_the_heap():
    r = probe("tune")
    assert r["tuned"] is True and r["again"] is True
    assert r["mmapped"] == 0


@pytest.mark.slow
def test_opt_out():
    r = probe("tune", env={"FLOWRT_MALLOC_TUNE": "0"})
    assert r["tuned"] is False and r["mmapped"] >= 24 * 2**20


@pytest.mark.slow
def test_a_cpu_engine_tunes_malloc():
    assert probe("engine", str(STORIES))["tuned"] is True


def _vma_flags(addr: int) -> tuple[list[str], int]:
    """VmFlags and resident kB of the mapping that holds addr (from /proc/self/smaps)."""
    inside, flags, rss = False, None, None
    for line in open("/proc/self/smaps"):
        parts = line.split()
        if len(parts) > 1 and "-" in parts[0] and parts[1][:1] in "r-":
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("Rss:"):
            rss = int(parts[1])
        elif inside and line.startswith("VmFlags:"):
            flags = parts[1:]
            break
    assert flags is not None and rss is not None, "mapping not found in /proc/self/smaps"
    return flags, rss


def test_kv_pool_is_lazy_zero_memory_without_huge_page_advice():
    """The pool is mapped page by page as blocks are first written, and not advised for transparent huge pages:
    numpy's zeros (used before) advised them, and with THP defrag on advice every first write to 2 MiB compacted
    memory inside the engine's steps (3 s per GiB on a 2-core VM, against 0.3 s with 4 KiB pages)."""
    import torch

    from flowrt.engine.kv.cache import zeros_lazy

    pool = zeros_lazy((4, 2, 256, 16, 2, 64), torch.float32, torch.device("cpu"))  # 64 MiB
    assert pool.is_contiguous() and pool.shape == (4, 2, 256, 16, 2, 64)
    mid = pool.data_ptr() + pool.numel() * 2
    flags, rss = _vma_flags(mid)
    assert "hg" not in flags, flags  # MADV_HUGEPAGE shows as "hg"
    assert rss < 8 * 1024, f"{rss} kB resident before any write: the pool is not lazy"
    pool[1, 0, 7] = 1.5
    assert float(pool.sum()) == 1.5 * 16 * 2 * 64 and float(pool.abs().sum()) == float(pool.sum())
    assert _vma_flags(mid)[1] < 16 * 1024
