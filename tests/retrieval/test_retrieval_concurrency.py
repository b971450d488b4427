"""Concurrent writers of one index: the writer lock, saves over a stale generation, cleanup, and readers
racing a writer (issue 11, item 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("faiss")
pytest.importorskip("sentence_transformers")

import flowrt.retrieval.retriever as rmod
from flowrt.retrieval import IndexConflictError, IndexLock, IndexLockedError, Retriever
from support import retrieval_cli as _cli
from flowrt.retrieval.lock import lock_path
from support import ROOT

TOPICS = ["Volcanoes erupt when magma rises.", "Glaciers carve valleys slowly.", "Tides follow the moon.",
          "Deserts get little rain."]


@pytest.fixture()
def index(tmp_path) -> Path:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "base.md").write_text("# Base\n\nThe first document of the index.\n")
    Retriever.build(docs, tmp_path / "idx", progress=False)
    return tmp_path / "idx"


def _new_docs(tmp_path: Path, n: int) -> list[Path]:
    out = []
    for i in range(n):
        f = tmp_path / f"new{i}" / f"topic{i}.md"
        f.parent.mkdir()
        f.write_text(f"# Topic {i}\n\n{TOPICS[i]}\n")
        out.append(f)
    return out


def test_concurrent_adds_from_threads_all_land(index, tmp_path):
    files = _new_docs(tmp_path, 4)
    _ = Retriever.load(index).embedder.model  # load the model once, outside the race
    start = threading.Barrier(len(files))
    codes: list[int] = []

    def add(f: Path) -> None:
        start.wait()
        codes.append(_cli("index", "add", index, f, "-q"))

    threads = [threading.Thread(target=add, args=(f,)) for f in files]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [0] * len(files)
    r = Retriever.load(index)
    assert r.sources == ["base.md"] + [f"topic{i}.md" for i in range(4)]
    assert r.search_sync("magma", k=1)[0].source == "topic0.md"
    assert len(list(index.iterdir())) == 4 and not lock_path(index).exists()  # one generation, no lock left


@pytest.mark.slow
def test_concurrent_cli_processes_all_land(index, tmp_path):
    files = _new_docs(tmp_path, 3)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "flowrt.retrieval.cli", "index", "add", str(index), str(f)],
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) for f in files]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errs
    assert all("1 added" in e for e in errs)
    assert Retriever.load(index).sources == ["base.md", "topic0.md", "topic1.md", "topic2.md"]


def test_lock_timeout_names_the_pid_that_holds_it(index, tmp_path, capsys):
    hold = ("import sys, time; from flowrt.retrieval import IndexLock\n"
            "with IndexLock(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(index)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(IndexLockedError, match=rf"index {index} is locked by pid {holder.pid}\b") as e:
            IndexLock(index, timeout=0.2).acquire()
        assert e.value.pid == holder.pid
        (f,) = _new_docs(tmp_path, 1)
        assert _cli("index", "add", index, f, "--lock-timeout", "0.3") == 1
        err = capsys.readouterr().err
        assert f"is locked by pid {holder.pid}" in err and "--lock-timeout" in err and "Traceback" not in err
    finally:
        holder.kill()
        holder.wait()
    with IndexLock(index, timeout=5):  # the kernel dropped the dead holder's lock
        pass
    assert _cli("index", "add", tmp_path / "nowhere" / "idx", f) == 1
    assert "no index at" in capsys.readouterr().err
    assert Retriever.load(index).sources == ["base.md"]


def test_saving_over_a_newer_generation_is_refused(index):
    first, second = Retriever.load(index), Retriever.load(index)
    first.add_texts(["Tides follow the moon."], ["tides.txt"])
    first.save()
    second.add_texts(["Deserts get little rain."], ["deserts.txt"])
    with pytest.raises(IndexConflictError, match=r"changed since this Retriever loaded it.*Retriever\.updating"):
        second.save()
    assert Retriever.load(index).sources == ["base.md", "tides.txt"]
    with Retriever.updating(index) as r:  # the way to do it: load under the lock, change, save
        r.add_texts(["Deserts get little rain."], ["deserts.txt"])
        r.save()
    assert Retriever.load(index).sources == ["base.md", "deserts.txt", "tides.txt"]


def test_cleanup_keeps_the_files_the_committed_manifest_names(index, monkeypatch):
    """A writer that does not take the lock (an older flowrt) commits between our commit and our cleanup."""
    other = Retriever.load(index)
    other.add_texts(["Glaciers carve valleys slowly."], ["glaciers.txt"])
    ours = Retriever.load(index)
    ours.add_texts(["Tides follow the moon."], ["tides.txt"])
    real_fsync_dir = rmod._fsync_dir
    raced = []

    def other_commits_now(d: Path) -> None:  # called right after our manifest is committed
        real_fsync_dir(d)
        if not raced:
            raced.append(d)
            other._write_generation(index, other.generation + 5)

    monkeypatch.setattr(rmod, "_fsync_dir", other_commits_now)
    ours.save()
    assert raced
    assert Retriever.load(index).sources == ["base.md", "glaciers.txt"]  # the last commit wins, and is complete


def test_load_retries_when_a_writer_commits_during_it(index, monkeypatch):
    """A reader that read the old manifest loses its files to the writer's cleanup, then loads the new one."""
    writer = Retriever.load(index)
    writer.add_texts(["Deserts get little rain."], ["deserts.txt"])
    real_sha = rmod._sha256_file
    raced = []

    def writer_commits_first(path: Path) -> str:
        if not raced:
            raced.append(path)
            writer.save()  # commits a new generation and deletes the one this load is verifying
        return real_sha(path)

    monkeypatch.setattr(rmod, "_sha256_file", writer_commits_first)
    r = Retriever.load(index)
    assert raced and r.sources == ["base.md", "deserts.txt"]
    assert json.loads((index / "manifest.json").read_text())["generation"] == r.generation
