"""Issue 39 item 3: a PostgreSQL checkpoint URL's password is never shown (CLI lines, hints, "already finished",
errors, `runs list`, logs): one URL-parsing redaction (flowrt.checkpoint.redact) everywhere a spec is shown."""

from __future__ import annotations

import logging
import urllib.parse

import pytest

from flowrt.checkpoint.redact import redact_url, scrub
from flowrt.cli.commands import main

PASSWORD = "s3cr3t-P@ss:w/rd"           # a raw '@', ':' and '/': percent-encoded in the URL
ENCODED = urllib.parse.quote(PASSWORD, safe="")
# what must appear nowhere: the password, encoded or not, and its pieces around each reserved character
LEAKS = [PASSWORD, ENCODED, "s3cr3t", "ss:w", "w/rd", "w%2Frd", "P%40ss"]

WORKFLOW = '''
import flowrt as fr

wf = fr.Workflow("approve")


@wf.step
async def ask() -> str:
    return await fr.interrupt("yes or no?")


@wf.step
def act(ask: str) -> str:
    return f"did {ask}"
'''


@pytest.mark.parametrize("url, shown", [
    (f"postgresql://flowrt:{ENCODED}@127.0.0.1:5432/db", "postgresql://flowrt:***@127.0.0.1:5432/db"),
    ("postgresql://flowrt:pa@ss@db.example:5432/runs", "postgresql://flowrt:***@db.example:5432/runs"),
    (f"postgres://db.example/runs?sslmode=require&password={ENCODED}&application_name=x",
     "postgres://db.example/runs?sslmode=require&password=***&application_name=x"),
    ("postgresql://flowrt:pa/ss#w@db.example/runs", "postgresql://***@db.example/runs"),   # raw '/' and '#'
    ("postgresql://flowrt@db.example/runs", "postgresql://flowrt@db.example/runs"),
    ("runs.db", "runs.db"),
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown


def test_scrub_masks_every_form_of_the_password():
    url = f"postgresql://flowrt:{ENCODED}@h/db"
    assert scrub(f"bad token {ENCODED!r} near {PASSWORD}", url) == "bad token '***' near ***"


def _all_output(capsys, caplog) -> str:
    out, err = capsys.readouterr()
    text = out + err + "\n".join(r.getMessage() for r in caplog.records)
    caplog.clear()
    return text


def test_no_output_of_a_postgres_run_shows_its_password(pg_url, tmp_path, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    user_host, db = pg_url.split("://", 1)[1].rsplit("/", 1)
    user, host = user_host.split("@")
    url = f"postgresql://{user}:{ENCODED}@{host}/{db}"            # the test server trusts any password
    in_query = f"postgresql://{user}@{host}/{db}?password={ENCODED}"
    f = tmp_path / "approve.py"
    f.write_text(WORKFLOW)
    seen = []

    def step(code: int, *argv: str) -> str:
        assert main(list(argv)) == code, seen
        seen.append(_all_output(capsys, caplog))
        return seen[-1]

    text = step(3, "run", str(f), "--checkpoint", url, "--no-progress")
    assert "checkpoints in postgresql://postgres:***@" in text and "continue it with" in text
    run_id = text.split("flowrt run: run ")[1].split(";")[0]
    step(0, "runs", "list", "--checkpoint", url)
    step(0, "runs", "list", "--checkpoint", in_query)
    step(0, "runs", "show", run_id, "--checkpoint", url)
    step(0, "resume", run_id, "--checkpoint", url, "--answer", "yes", "--no-progress")
    assert "already finished" in step(2, "resume", run_id, "--checkpoint", in_query, "--answer", "again")
    step(2, "resume", "no-such-run", "--checkpoint", url)
    assert "does not exist" in step(2, "runs", "list", "--checkpoint", url.rsplit("/", 1)[0] + "/no_such_db")
    assert "cannot connect" in step(2, "runs", "list", "--checkpoint", f"postgresql://u:{ENCODED}@127.0.0.1:1/db")
    everything = "\n".join(seen)
    assert run_id in everything
    for leak in LEAKS:
        assert leak not in everything
