"""A throwaway PostgreSQL server for the PostgreSQL checkpoint store's tests: Debian's `postgresql` package
(initdb + pg_ctl) in a temporary folder on a free port, stopped and deleted afterwards.

PostgreSQL refuses to run as root: as root the server runs as the `postgres` user (the package creates it),
else as `nobody`. ``PgServer.start`` returns None with the reason when it cannot run here (no server
binaries, no psycopg), for a skip that says why.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid

__all__ = ["PgServer"]


def _bin_dir() -> str | None:
    found = shutil.which("pg_ctl")
    if found and shutil.which("initdb"):
        return os.path.dirname(found)
    dirs = [d for d in glob.glob("/usr/lib/postgresql/*/bin") if os.path.exists(os.path.join(d, "pg_ctl"))]
    dirs.sort(key=lambda d: int(d.split("/")[-2]) if d.split("/")[-2].isdigit() else 0)
    return dirs[-1] if dirs else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    def __init__(self, bin_dir: str, root: str, user: str | None) -> None:
        self.bin_dir, self.root, self.user = bin_dir, root, user
        self.data = os.path.join(root, "data")
        self.port = _free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @classmethod
    def start(cls) -> tuple["PgServer | None", str]:
        try:
            import psycopg  # noqa: F401
        except ImportError:
            return None, "psycopg 3 is not installed (pip install 'flowrt[postgres]')"
        bin_dir = _bin_dir()
        if bin_dir is None:
            return None, "PostgreSQL server binaries (initdb, pg_ctl) not found: apt-get install postgresql"
        user = None
        if os.geteuid() == 0:
            names = {p.pw_name for p in pwd.getpwall()}
            user = "postgres" if "postgres" in names else "nobody"
        root = tempfile.mkdtemp(prefix="flowrt-pg-")
        if user is not None:
            pw = pwd.getpwnam(user)
            os.chown(root, pw.pw_uid, pw.pw_gid)
        srv = cls(bin_dir, root, user)
        try:
            srv._run("initdb", "-D", srv.data, "-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C",
                     "--no-sync")
            opts = (f"-p {srv.port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off "
                    "-c full_page_writes=off -c synchronous_commit=off")
            srv._run("pg_ctl", "-D", srv.data, "-l", os.path.join(root, "log"), "-w", "-t", "60", "-o", opts, "start")
        except (OSError, subprocess.CalledProcessError) as e:
            log = os.path.join(root, "log")
            tail = open(log).read()[-2000:] if os.path.exists(log) else getattr(e, "stderr", "") or ""
            shutil.rmtree(root, ignore_errors=True)
            return None, f"cannot start a PostgreSQL server: {e}\n{tail}"
        return srv, ""

    def _run(self, tool: str, *args: str) -> None:
        cmd = [os.path.join(self.bin_dir, tool), *args]
        if self.user is not None:
            cmd = ["runuser", "-u", self.user, "--", *cmd] if shutil.which("runuser") else \
                ["su", "-s", "/bin/sh", self.user, "-c", " ".join(f"'{a}'" for a in cmd)]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120, cwd=self.root)

    def new_database(self) -> str:
        """A fresh, empty database (its URL): each test starts from nothing."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url, autocommit=True) as c:
            c.execute(f"CREATE DATABASE {name}")
        return self.url.rsplit("/", 1)[0] + "/" + name

    def drop_database(self, url: str) -> None:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as c:
            c.execute(f"DROP DATABASE IF EXISTS {url.rsplit('/', 1)[1]} WITH (FORCE)")

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
