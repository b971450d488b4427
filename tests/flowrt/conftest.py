import pytest

from support import STORIES


@pytest.fixture(scope="module")
def engine():
    """An AsyncLLM on stories260K for the thread tests (a module that needs another model overrides it)."""
    from flowrt.engine import AsyncLLM

    eng = AsyncLLM(model=str(STORIES), dtype="float32", num_kv_blocks=512, seed=0)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def pg_server():
    """A PostgreSQL server for the session (tests/pg_server.py); skips, saying why, where none can run."""
    from pg_server import PgServer

    srv, why = PgServer.start()
    if srv is None:
        pytest.skip(why)
    yield srv
    srv.stop()


@pytest.fixture
def pg_url(pg_server):
    """A fresh database on the session's PostgreSQL server (its URL), dropped afterwards."""
    url = pg_server.new_database()
    yield url
    pg_server.drop_database(url)


@pytest.fixture(params=["sqlite", "postgres"])
def store_spec(request, tmp_path) -> str:
    """Checkpoint store tests run on both stores: an SQLite file, and a fresh database on a real PostgreSQL
    server (tests/pg_server.py; skipped, saying why, where none can run)."""
    if request.param == "sqlite":
        return str(tmp_path / "runs.db")
    return request.getfixturevalue("pg_url")
