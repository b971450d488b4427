"""Replicas on a multi-node Ray cluster (ray.cluster_utils.Cluster: one raylet per node on this machine, each with
its own CPUs): one replica per node, KV pulled between replicas, runs that survive a killed node on PostgreSQL
(taken over from their last checkpoint, every finished step once, KV from the shared block directory), a node
that joins, and the typed error once no replica is left. One cluster (a head without CPUs and 3 workers of 1 CPU)
and one runtime per module; the tests run in order (each kill leaves the cluster as the next one expects).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time

import pytest

import flowrt as fr

ray = pytest.importorskip("ray", reason="flowrt.replicas needs ray (pip install 'flowrt[ray]')")
pytestmark = pytest.mark.timeout(600)
SLOW_FIXTURES = {"cluster"}

# ~300 tokens shared by every run (stories260K holds 512 positions)
PREFIX = ("Once upon a time there was a little girl named Lily. She liked to play in the park with her friends. "
          "One day she saw a big red ball under a tree and she wanted to play with it. Her mom said she could "
          "play for a while and then they would go home to eat. Lily ran to the ball and kicked it very hard. "
          "The ball flew over the fence and into the garden of an old man. The old man came out and he was not "
          "happy. Lily said sorry and the old man smiled and gave the ball back. They became good friends and "
          "Lily came to see him every day after that. ") * 1
FINISHED: collections.Counter = collections.Counter()   # (tag, step) -> times the step finished


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 4}})
    workers = [c.add_node(num_cpus=1) for _ in range(3)]
    ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    c.wait_for_nodes()
    yield c, workers
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def rt(cluster, stories_path, pg_server, tmp_path_factory):
    c, _ = cluster
    url = pg_server.new_database()
    runtime = fr.Runtime(stories_path, replicas=3, ray_address=c.address, max_model_len=512, dtype="float32",
                         checkpoint=url, checkpoint_kv=str(tmp_path_factory.mktemp("kv") / "blocks"),
                         replica_options={"poll_interval": 0.05, "max_restarts": 4, "takeover_wait_s": 60})
    asyncio.run(runtime.model())
    yield runtime
    runtime.close()
    pg_server.drop_database(url)


def rs_of(rt):
    return rt.llm.engine.replica_set


class Hold:
    """Holds each fork of the answer step of the runs it names once that fork is generating (its request on the
    run's replica, the run past its context checkpoint), until released: the kill test kills a node at that point,
    however slowly a loaded machine got there. A run fails with its replica's death if one of its forks has more to
    read from it: one whose first read brought only part of its tokens."""

    def __init__(self, tags: list[str], forks: int = 4) -> None:
        self.tags, self.forks = set(tags), forks
        self.generating: collections.Counter = collections.Counter()   # tag -> forks held
        self.replica: dict[str, int] = {}                              # tag -> the replica its run is bound to
        self.unread: set[str] = set()                                  # tags with a fork that has more to read
        self.released = False

    async def at(self, tag: str, replica: int, more: bool) -> None:
        if tag not in self.tags or self.released:
            return
        self.replica[tag] = replica
        self.generating[tag] += 1
        if more:
            self.unread.add(tag)
        while not self.released:   # the steps and the test share one event loop
            await asyncio.sleep(0.01)

    def all_held(self) -> bool:
        return all(self.generating[t] == self.forks for t in self.tags)

    def victims(self) -> list[int]:
        """The replicas each of whose runs will fail when it dies."""
        return sorted({r for r in self.replica.values()
                       if all(t in self.unread for t, x in self.replica.items() if x == r)})


def make_wf(max_tokens: int, hold: Hold | None = None):
    wf = fr.Workflow("multinode")

    @wf.step
    def prep(tag: str) -> str:
        FINISHED[(tag, "prep")] += 1
        return PREFIX

    @wf.step
    async def context(prep: str, tag: str, llm: fr.Model) -> fr.Thread:
        t = llm.thread(prep + f" Tag {tag}.")
        await t.gen(max_tokens=40, temperature=0, ignore_eos=True)   # blocks of this run alone
        FINISHED[(tag, "context")] += 1
        return t

    async def held_gen(s: fr.Thread, tag: str, llm: fr.Model) -> str:
        assert hold is not None
        pieces, before = [], len(s.token_ids)
        async with contextlib.aclosing(s.stream(max_tokens=max_tokens, temperature=0, ignore_eos=True)) as it:
            async for piece in it:
                pieces.append(piece)
                if len(pieces) == 1:   # token_ids: what the stream has read so far
                    more = len(s.token_ids) - before < max_tokens // 2
                    await hold.at(tag, llm.engine.replica.index, more)
        return "".join(pieces)

    @wf.step
    async def answer(context: fr.Thread, tag: str, llm: fr.Model) -> dict:
        if hold is None:
            t = context + f" Question {tag}:"
            texts = await fr.gather(*(s.gen(max_tokens=max_tokens, temperature=0, ignore_eos=True)
                                      for s in t.fork(4)))
        else:   # the forks generate from the checkpointed thread itself: a takeover computes what its KV lacks
            texts = await fr.gather(*(held_gen(s, tag, llm) for s in context.fork(hold.forks)))
        FINISHED[(tag, "answer")] += 1
        return {"text": texts[0], "replica": llm.engine.replica.index}

    @wf.step
    def report(answer: dict, tag: str) -> str:
        FINISHED[(tag, "report")] += 1
        return answer["text"]

    return wf


def kill_now(node, *pids: int) -> None:
    """SIGKILL a node's raylet and the given worker processes at once (remove_node takes a while)."""
    import os
    import signal

    for info in node.all_processes.get("raylet", []):
        pids += (info.process.pid,)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait(cond, timeout: float = 120.0) -> None:
    """Until ``cond()``; the timeout only bounds a hang."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


async def until(cond, tasks: list[asyncio.Task], why, timeout: float = 300.0) -> None:
    """Until ``cond()`` while the runs go on (a run that ends first fails the test, with its errors); the timeout
    only bounds a hang."""
    deadline = time.monotonic() + timeout
    while not cond():
        ended = [t.result() for t in tasks if t.done()]
        assert not ended, [(r.status, r.errors) for r in ended]
        assert time.monotonic() < deadline, f"timed out: {why()}"
        await asyncio.sleep(0.01)


def test_one_replica_per_node(rt, cluster):
    _, workers = cluster
    rs = rs_of(rt)
    nodes = {w.node_id for w in workers}
    assert {h.node_id for h in rs.replicas} == nodes   # one on each worker, none on the head (no CPUs)
    stats = rt.stats()["replicas"]
    assert sorted(s["node_id"] for s in stats) == sorted(nodes)
    assert all(h.fingerprint == rs.replicas[0].fingerprint != "" for h in rs.replicas)


def test_busy_holder_pull_instead_of_prefill(rt):
    """The prefix's holder is busy: the run goes to another replica, which pulls the prefix's blocks from it
    (across nodes) and computes only the rest; greedy output equals the holder's."""
    rs = rs_of(rt)
    wf = make_wf(8)
    first = asyncio.run(rt.run(wf, tag="p0"))
    assert first.ok, first.errors
    holder = rs.replicas[first.outputs["answer"]["replica"]]
    time.sleep(0.3)
    rs.refresh()
    before = {h.index: dict(h.stats) for h in rs.replicas}
    holder.in_flight += 100   # looks busy: the load fallback sends the next run elsewhere
    try:
        second = asyncio.run(rt.run(wf, tag="p0"))
    finally:
        holder.in_flight -= 100
    assert second.ok, second.errors
    other = rs.replicas[second.outputs["answer"]["replica"]]
    assert other is not holder and other.node_id != holder.node_id
    time.sleep(0.3)
    rs.refresh()
    pulled = other.stats["kv_blocks_pulled"] - before[other.index]["kv_blocks_pulled"]
    computed = other.stats["prefill_tokens_computed"] - before[other.index]["prefill_tokens_computed"]
    prompt = len(rs.tokenizer(PREFIX)["input_ids"])
    assert pulled >= prompt // rs.block_size - 1
    assert computed < 2 * rs.block_size + 16, computed   # the last partial block and the question only
    assert second.outputs["report"] == first.outputs["report"]


def test_kv_export_asks_past_a_stale_index(rt):
    """A checkpoint saves a thread's blocks right after its generation, often before the poller has heard that its
    replica stored the last of them: the export must still come from the replica that holds them, not from one that
    (by the index) holds only their shared beginning."""
    from flowrt.engine import SamplingParams

    rs = rs_of(rt)
    client = rt.llm.engine.bind()
    holder, other = rs.replicas[0], rs.replicas[1]
    client._bind_to(holder)
    ids = [(7 * i) % 500 + 3 for i in range(5 * rs.block_size + 3)]   # no other test's prompt
    asyncio.run(client.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1)))
    client.release()
    hashes = rs.index.hashes(ids)
    wait(lambda: rs.index.match(hashes, [holder.index])[holder.index] == len(hashes))   # the poller heard
    with rs.router.lock:   # as seen before it had: the other replica looks like the best holder
        rs.index.clear(holder.index)
        rs.index.add(other.index, hashes[:2])
    blocks = rt.llm.engine.kv_export(ids)
    assert len(blocks) == len(hashes) and all(d for _, d in blocks)


def test_node_killed_mid_run_postgres(rt, cluster):
    """A worker node dies while its replica generates: its runs are taken over by the survivors from their last
    checkpoint (PostgreSQL), every finished step ran once, the outputs are the same as on a healthy replica.
    The node dies at a known point of the runs (every fork of every run generating, held there by the test), so
    neither the machine's load nor how soon Ray sees the death decides which runs it takes down."""
    c, workers = cluster
    rs = rs_of(rt)
    tags = [f"k{i}" for i in range(6)]
    hold = Hold(tags)
    wf = make_wf(150, hold)
    FINISHED.clear()
    reference = asyncio.run(rt.run(wf, tag="ref"))
    rs.router.routing = "round_robin"

    async def go():
        tasks = [asyncio.create_task(rt.run(wf, tag=t)) for t in tags]
        await until(hold.all_held, tasks, lambda: (dict(hold.generating), rs.replica_stats()))
        assert hold.victims(), f"every replica had a run whose forks read all their tokens at once: {hold.replica}"
        victim = rs.replicas[hold.victims()[0]]
        node = next(w for w in workers if w.node_id == victim.node_id)
        kill_now(node, victim.pid)
        hold.released = True   # the victim's runs fail on their next read of its streams, the others go on
        await asyncio.to_thread(c.remove_node, node, False)   # and the rest of the node's processes
        return victim, node, await asyncio.gather(*tasks)

    try:
        victim, node, results = asyncio.run(go())
    finally:
        rs.router.routing = "prefix"
        hold.released = True
    workers.remove(node)
    assert all(r.ok for r in results), [r.errors for r in results]
    tag_of = {r.run_id: rt.checkpointer.get_run(r.run_id, with_state=False).inputs["tag"] for r in results}
    taken = [r for r in results if r.stats.get("takeovers")]
    assert {tag_of[r.run_id] for r in taken} == {t for t in tags if hold.replica[t] == victim.index}
    assert all(r.stats["takeovers"] == 1 for r in taken)
    assert all(r.outputs["answer"]["replica"] != victim.index for r in taken)
    twice = {k: n for k, n in FINISHED.items() if n != 1}
    assert not twice, twice   # every finished step ran once
    assert set(FINISHED) == {(t, s) for t in tags + ["ref"] for s in ("prep", "context", "answer", "report")}
    for r in taken:
        assert r.stats["kv_blocks_loaded"] >= 2 and not r.stats["kv_blocks_rejected"], r.stats   # the shared store
        # The takeover computes at most one block of the restored thread (its last partial one, which its forks
        # share) and each fork's last token; without the store it would compute the run's own blocks (~50 tokens)
        assert hold.forks <= r.stats["takeover_tokens_computed"] <= rs.block_size + hold.forks, r.stats
        rec = rt.checkpointer.get_run(r.run_id, with_state=False)
        assert rec.status == "done"
    assert reference.ok
    for r in taken[:1]:   # the same greedy text as a run no death interrupted
        assert asyncio.run(rt.run(wf, tag=tag_of[r.run_id])).outputs["report"] == r.outputs["report"]


def test_node_joins_takes_new_runs(rt, cluster):
    """A node joins: Ray restarts the dead replica there (it waited for room) and the router sends it new runs."""
    c, workers = cluster
    rs = rs_of(rt)
    dead = [h for h in rs.replicas if not h.healthy]
    assert len(dead) == 1
    new = c.add_node(num_cpus=1)
    workers.append(new)
    wait(lambda: dead[0].healthy, timeout=300)   # its engine starting on the new node: slow on a loaded machine
    assert dead[0].node_id == new.node_id
    rs.router.routing = "round_robin"   # three runs, three live replicas: one each
    try:
        async def go():
            return await asyncio.gather(*(rt.run(make_wf(4), tag=f"j{i}") for i in range(3)))

        results = asyncio.run(go())
    finally:
        rs.router.routing = "prefix"
    assert all(r.ok for r in results), [r.errors for r in results]
    assert sorted(r.outputs["answer"]["replica"] for r in results) == sorted(h.index for h in rs.replicas)


def test_http_run_and_metrics_name_each_node(rt, cluster, stories_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from flowrt.server.app import create_app
    from flowrt.server.background import BackgroundServer

    _, workers = cluster
    wf = make_wf(4)
    with BackgroundServer(create_app(rt.llm.engine, model_path=stories_path, workflows={"multinode": wf},
                                     workflow_runtime=rt)) as srv:
        r = httpx.post(f"{srv.url}/v1/workflows/multinode/runs", json={"inputs": {"tag": "h0"}}, timeout=120)
        assert r.status_code == 200, r.text
        metrics = httpx.get(f"{srv.url}/metrics", timeout=60).text
    for w in workers:
        assert f'node_id="{w.node_id}"' in metrics


def test_no_replica_left_is_a_typed_error(rt, cluster):
    """Every worker node gone: the run cannot be taken over; rt.run raises NoReplicaError naming the run, which
    stays failed (resumable) in the store."""
    from flowrt.replicas import NoReplicaError

    c, workers = cluster
    rs = rs_of(rt)
    rs.takeover_wait_s = 3.0
    wf = make_wf(200)

    async def go():
        task = asyncio.create_task(rt.run(wf, tag="last"))
        deadline = time.monotonic() + 60
        while not any(h.in_flight for h in rs.replicas) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for w in list(workers):
            kill_now(w, *(h.pid for h in rs.replicas if h.node_id == w.node_id))
        for w in list(workers):
            await asyncio.to_thread(c.remove_node, w, False)
        workers.clear()
        return await task

    with pytest.raises(NoReplicaError, match=r"run \S+: its replica died and no replica came back") as err:
        asyncio.run(go())
    run_id = str(err.value).split()[1].rstrip(":")
    assert rt.checkpointer.get_run(run_id, with_state=False).status == "failed"
    # A new run now finds no replica at all: the same wait, then over HTTP a 503 that says so.
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from flowrt.server.app import create_app
    from flowrt.server.background import BackgroundServer

    with BackgroundServer(create_app(rt.llm.engine, workflows={"multinode": wf}, workflow_runtime=rt)) as srv:
        r = httpx.post(f"{srv.url}/v1/workflows/multinode/runs", json={"inputs": {"tag": "h1"}}, timeout=120)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "no_replica" and "no replica came back" in r.json()["error"]["message"]
