"""Run an app with uvicorn in a background thread on a loopback port (tests, benchmarks, notebooks)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

LOOPBACK = ("127.0.0.1", "::1", "localhost")


class BackgroundServer:
    """``with BackgroundServer(app) as srv: httpx.get(srv.url + "/health")``.

    Binds `host:port` (port 0 picks a free port) before the thread starts, so the port is known at once.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 timeout_graceful_shutdown: int | None = 5) -> None:
        if host not in LOOPBACK:
            raise ValueError(f"BackgroundServer binds loopback addresses only, not {host!r}")
        self.app = app
        self.host = host
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level=log_level, lifespan="on", access_log=False,
                                timeout_graceful_shutdown=timeout_graceful_shutdown)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="flowrt-server", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread exited during startup")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
