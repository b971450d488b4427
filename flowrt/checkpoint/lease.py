"""Run leases: who executes a checkpointed run, so that two resumes never run it twice.

A holder is named ``host:pid:random`` (one per run execution; two resumes in one process differ). The
holder renews its lease every ``ttl / 3`` seconds from one background thread per process (a thread, so a
step that blocks the event loop does not let the lease run out), and a holder that died stops renewing:
its lease runs out after ``LEASE_TTL_S``. On the same host a dead holder is seen at once (its pid is gone,
or is a zombie its parent has not reaped yet), so ``flowrt resume`` right after a crash does not wait for the expiry.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from typing import Any

__all__ = ["LEASE_TTL_S", "new_holder", "holder_is_dead", "live_holder", "Renewer", "renewer"]

LEASE_TTL_S = 30.0


def new_holder() -> str:
    """A fresh holder name for this process: ``host:pid:random``."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def holder_is_dead(holder: str) -> bool:
    """True when ``holder`` names a process of this host that no longer exists (False when unsure: another
    host, a pid that exists, or a name of another form)."""
    parts = holder.rsplit(":", 2)
    if len(parts) != 3 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:   # exists, owned by another user
        pass
    return _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    """True when ``pid`` has exited but its parent has not reaped it yet (state Z, or X: dead), as right after
    a ``kill -9``: its pid still exists, but it runs nothing. False when unsure (no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 1:].split()[:1]   # after the command name, which may hold ')' and spaces
    return state in ([b"Z"], [b"X"])


def live_holder(record: Any) -> str | None:
    """Who holds a stored run (a ``RunRecord``) now: its lease holder while the lease is live and the holder
    not known dead, else None (a ``running`` run with none crashed, and can be resumed)."""
    holder, expires = record.holder, record.lease_expires
    if holder is None or expires is None or expires <= time.time() or holder_is_dead(holder):
        return None
    return holder


class Renewer:
    """Renews the leases this process holds, each every ``ttl / 3`` seconds, from one daemon thread (started
    when a lease is first held, gone when none is)."""

    def __init__(self) -> None:
        self._held: dict[tuple[int, str, str], tuple[Any, float, float]] = {}   # key -> (store, ttl, due)
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    def hold(self, store: Any, run_id: str, holder: str, ttl: float) -> None:
        with self._wake:
            self._held[(id(store), run_id, holder)] = (store, ttl, time.monotonic() + ttl / 3)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="flowrt-lease-renewer", daemon=True)
                self._thread.start()
            self._wake.notify()

    def drop(self, store: Any, run_id: str, holder: str) -> None:
        with self._wake:
            self._held.pop((id(store), run_id, holder), None)

    def _loop(self) -> None:
        while True:
            with self._wake:
                if not self._held:
                    self._thread = None
                    return
                now = time.monotonic()
                due = [(k, v) for k, v in self._held.items() if v[2] <= now]
                if not due:
                    self._wake.wait(min(v[2] for v in self._held.values()) - now)
                    continue
                for k, (store, ttl, _) in due:
                    self._held[k] = (store, ttl, now + ttl / 3)
            for key, (store, ttl, _) in due:
                try:
                    kept = store.renew_lease(key[1], key[2], ttl)
                except Exception:  # noqa: BLE001 - a busy or closed store: try again next round
                    continue
                if not kept:   # taken over: its next save is refused (LeaseLostError), which ends the run
                    self.drop(store, key[1], key[2])


_RENEWER = Renewer()


def renewer() -> Renewer:
    return _RENEWER
