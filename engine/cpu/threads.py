"""CPU thread governor: fewer compute threads while other processes take the cores, back up when they free.

A CPU step runs ~100-400 OpenMP parallel regions (every kernel and oneDNN matmul of every layer), and each ends at a
barrier: when another process holds one of the cores, every barrier waits for the descheduled thread, and the
waiting thread spins meanwhile. On a 2-core machine shared with other jobs (load ~9) a 16-request batch took 38 s
with 2 threads against 5.2 s with 1 thread and ~2.5 s on the quiet machine (AMD EPYC, bf16). So the engine watches
whether its steps get the cores their threads need, from the process's CPU time against the steps' wall time: a
step whose threads all run consumes ~threads x wall of CPU (spinning included); a starved one much less. After
`starved_windows` consecutive starved windows the governor drops one thread; every `probe_s` (doubling, up to
`max_probe_s`, while probes keep failing) it tries one more thread for a window and keeps it if the window was not
starved. It only ever lowers below the count the engine started with, never raises above it.

torch's thread count is process-wide, and the fused kernels follow it (engine/cpu/ops.py), so this governs every
CPU op of the process. `EngineArgs(adaptive_threads=False)` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class ThreadGovernor:
    max_threads: int
    set_threads: Callable[[int], None] = torch.set_num_threads
    window_s: float = 0.5  # steps' wall time per judged window
    low: float = 0.8  # CPU / (wall x threads) below this: the window was starved
    starved_windows: int = 2
    probe_s: float = 2.0
    max_probe_s: float = 30.0
    threads: int = field(init=False)
    changes: int = field(default=0, init=False)  # how many times the count changed (stats)

    def __post_init__(self) -> None:
        self.threads = self.max_threads
        self._wall = self._cpu = 0.0
        self._starved = 0
        self._probing = False
        self._next_probe = 0.0
        self._backoff = self.probe_s

    def _set(self, n: int) -> None:
        if n != self.threads:
            self.threads = n
            self.changes += 1
            self.set_threads(n)

    def observe(self, wall: float, cpu: float, now: float) -> None:
        """One step's wall and process CPU seconds (its forward), ending at `now` (a monotonic clock)."""
        self._wall += wall
        self._cpu += cpu
        if self._wall < self.window_s:
            if not self._probing and self.threads < self.max_threads and now >= self._next_probe:
                self._probing = True  # the next window runs with one more thread
                self._set(self.threads + 1)
                self._wall = self._cpu = 0.0
            return
        starved = self._cpu < self.low * self._wall * self.threads
        self._wall = self._cpu = 0.0
        if self._probing:
            self._probing = False
            if starved:
                self._set(self.threads - 1)
                self._backoff = min(self._backoff * 2, self.max_probe_s)
            else:
                self._backoff = self.probe_s
            self._next_probe = now + self._backoff
            return
        self._starved = self._starved + 1 if starved and self.threads > 1 else 0
        if self._starved >= self.starved_windows:
            self._starved = 0
            self._set(self.threads - 1)
            self._next_probe = now + self._backoff


class StepClock:
    """Times a step for the governor: wall and process CPU (all threads: the OpenMP workers count)."""

    __slots__ = ("gov", "_w", "_c")

    def __init__(self, gov: ThreadGovernor | None):
        self.gov = gov

    def __enter__(self) -> "StepClock":
        if self.gov is not None:
            self._w, self._c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        if self.gov is not None:
            w = time.perf_counter()
            self.gov.observe(w - self._w, time.process_time() - self._c, w)


@functools.cache
def _libgomp_pause() -> Callable[[int], int] | None:
    """libgomp's omp_pause_resource_all (OpenMP 5.0, GCC 9+) from the copy torch loaded, or None without one."""
    try:
        fn = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY).omp_pause_resource_all
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def release_openmp_team() -> bool:
    """Ends the OpenMP worker threads of the calling thread's team (its next parallel region starts new ones).

    One libgomp serves torch and the kernels, and every thread that starts a parallel region keeps a team of its own.
    Once the process has more OpenMP threads than cores, libgomp's workers stop spinning between regions (100 spins,
    then a futex sleep and wake-up each time): a thread that ran a torch op (a retriever's embedding, a model load)
    and lives on made the engine's decode steps 1.7x slower (2 cores, Xeon, SmolLM2-135M Q8_0: 176 -> 103 tok/s).
    So a thread other than the engine's calls this when its compute is done. True when the team was released; False
    where the OpenMP runtime is not libgomp, is older than GCC 9, or the thread is inside a parallel region.
    """
    pause = _libgomp_pause()
    return pause is not None and pause(1) == 0  # 1: omp_pause_soft
