"""Issue 27 items 5-6: reading commands (``flowrt runs list|show``) open a checkpoint database read-only
(and work on a read-only file system), writing ones say it is read-only (not "corrupt"), and no command but
``run`` creates a database."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys

import pytest

from flowrt.checkpoint import SCHEMA_VERSION, CheckpointError, ReadOnlyStoreError, SQLiteStore
from flowrt.cli.commands import main
from support import ROOT

WF = "import flowrt as fr\nwf = fr.Workflow('w')\n@wf.step\ndef a() -> int:\n    return 1\n"

# Runs several CLI commands in one process and prints [[exit code, stdout, stderr], ...] as JSON.
RUNNER = '''
import contextlib, io, json, sys
from flowrt.cli.commands import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    results.append([code, out.getvalue(), err.getvalue()])
sys.__stdout__.write(json.dumps(results))
'''


def _stored_run(db) -> None:
    store = SQLiteStore(db)
    store.create_run("r1", "w", {"x": 1}, file="wf.py")
    store.save("r1", step="a", visit=1, step_status="done", result={"json": 1}, route=None, threads=[],
               state={"status": {"a": "done"}, "outputs": {"a": {"json": 1}}}, run_status="running")
    store.close()


def _can_mount_read_only() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-m", "true"], capture_output=True).returncode == 0


def _cli_on_read_only_folder(folder, commands: list[list[str]]) -> list:
    """The commands, run while ``folder`` is read-only: a read-only bind mount in a private mount namespace
    (root: file permissions do not stop root), else its write permissions taken away."""
    argv = [sys.executable, "-c", RUNNER, json.dumps(commands)]
    if os.geteuid() == 0:
        if not _can_mount_read_only():
            pytest.skip("root without unshare -m: no way to make a read-only file system here")
        argv = ["unshare", "-m", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(folder), *argv]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    else:
        modes = {p: p.stat().st_mode for p in [folder, *folder.iterdir()]}
        for p in modes:
            p.chmod(0o555 if p.is_dir() else 0o444)
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
        finally:
            for path, mode in modes.items():
                path.chmod(mode)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.slow
def test_a_read_only_database_is_read_and_never_called_corrupt(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    db = ro / "ck.db"
    _stored_run(db)
    (ro / "wf.py").write_text(WF)
    assert sorted(os.listdir(ro)) == ["ck.db", "wf.py"]      # no -wal / -shm left: the file alone
    digest = hashlib.sha256(db.read_bytes()).hexdigest()
    listed, shown, history, ran, resumed = _cli_on_read_only_folder(ro, [
        ["runs", "list", "--checkpoint", str(db)],
        ["runs", "show", "r1", "--checkpoint", str(db)],
        ["runs", "history", "r1", "--checkpoint", str(db)],
        ["run", str(ro / "wf.py"), "--checkpoint", str(db), "--no-progress"],
        ["resume", "r1", "--checkpoint", str(db), "--no-progress"],
    ])
    assert listed[0] == 0 and listed[1].startswith("r1  running"), listed
    assert shown[0] == 0 and json.loads(shown[1])["outputs"] == {"a": 1}, shown
    assert history[0] == 0 and " a " in history[1], history
    for code, _, err in (ran, resumed):
        assert code == 2 and f"checkpoint database {db} is read-only" in err and "corrupt" not in err, err
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest


def test_reading_commands_never_create_a_database(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for argv in (["runs", "list", "--checkpoint", "typo.db"], ["runs", "show", "r1", "--checkpoint", "typo.db"],
                 ["resume", "r1", "--checkpoint", "typo.db"]):
        assert main(argv) == 2
        assert "no checkpoint database at typo.db" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_a_store_opened_read_only_refuses_writes(tmp_path):
    db = tmp_path / "ck.db"
    _stored_run(db)
    store = SQLiteStore(db, readonly=True)
    assert store.get_run("r1").state["outputs"] == {"a": {"json": 1}}
    with pytest.raises(ReadOnlyStoreError, match="opened read-only"):
        store.claim_run("r1", "h:1:a", 30)
    store.close()


def test_an_older_format_is_read_as_it_is_and_converted_only_when_written(tmp_path):
    db = tmp_path / "old.db"
    _stored_run(db)
    con = sqlite3.connect(db)     # back to format 2: the same file without the lease columns
    con.executescript("ALTER TABLE runs DROP COLUMN lease_holder; ALTER TABLE runs DROP COLUMN lease_expires; "
                      "UPDATE schema_version SET version = 2;")
    con.close()
    ro = SQLiteStore(db, readonly=True)
    (rec,) = ro.list_runs()
    assert rec.run_id == "r1" and rec.holder is None and ro.get_run("r1").state["outputs"] == {"a": {"json": 1}}
    ro.close()
    SQLiteStore(db).claim_run("r1", "h:1:a", 30)
    con = sqlite3.connect(db)
    assert con.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] == SCHEMA_VERSION == 3
    assert con.execute("SELECT lease_holder FROM runs").fetchone()[0] == "h:1:a"
    con.execute("UPDATE schema_version SET version = 1")   # format 1 has its state elsewhere: not read read-only
    con.commit()
    con.close()
    with pytest.raises(CheckpointError, match="checkpoint format 1 .* reading commands do not convert"):
        SQLiteStore(db, readonly=True)


def _pg_tables(url: str) -> list[str]:
    import psycopg

    with psycopg.connect(url) as c:
        return [r[0] for r in c.execute("SELECT table_name FROM information_schema.tables "
                                        "WHERE table_schema = current_schema()")]


def test_reading_commands_never_create_postgres_tables(pg_url, capsys):
    """Issue 39 item 15: on PostgreSQL as on SQLite, reading never writes."""
    from flowrt.checkpoint import open_store

    for argv in (["runs", "list"], ["runs", "show", "r1"], ["runs", "history", "r1"], ["resume", "r1"]):
        assert main([*argv, "--checkpoint", pg_url]) == 2
        assert "no flowrt checkpoints in" in capsys.readouterr().err
    assert _pg_tables(pg_url) == []
    writer = open_store(pg_url)
    writer.create_run("r1", "w", {"x": 1})
    writer.close()
    tables = sorted(_pg_tables(pg_url))
    store = open_store(pg_url, readonly=True)
    assert store.get_run("r1").status == "running" and [r.run_id for r in store.list_runs()] == ["r1"]
    with pytest.raises(ReadOnlyStoreError, match="opened read-only"):
        store.claim_run("r1", "h:1:a", 30)
    store.close()
    assert main(["runs", "list", "--checkpoint", pg_url]) == 0 and "r1" in capsys.readouterr().out
    assert sorted(_pg_tables(pg_url)) == tables
