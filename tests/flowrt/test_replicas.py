"""Engine replicas as Ray actors (flowrt.replicas): affinity, prefix-aware routing, load fallback, parity with
the single-process runtime, and a replica's death mid-run (other runs finish, a retried step finishes on the
survivor, the dead replica comes back). One Ray instance (num_cpus=2) and one 2-replica runtime per module;
the death tests run last."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from flowrt.engine.kv.block_pool import BlockPool

import flowrt as fr

SYSTEM_A = ("Once upon a time there was a little girl named Lily. She liked to play in the park with her "
            "friends. One day she saw a big red ball under a tree and she wanted to play with it. ")
SYSTEM_B = ("Tom had a dog named Max. Max was a good dog and he liked to run. Every morning Tom and Max went "
            "for a walk by the river and looked at the boats. ")


def test_block_pool_event_feed():
    """The cache-event feed the router's index is kept current from: stored on register, evicted on reuse."""
    pool = BlockPool(2)
    pool.enable_events(maxlen=8)
    a = pool.allocate()
    pool.register(a, b"h1")
    pool.decref(a)
    b = pool.allocate()  # the uncached block
    c = pool.allocate()  # evicts h1
    assert {a, b} == {0, 1} or c == a
    assert list(pool.events) == [(True, b"h1"), (False, b"h1")]
    for i in range(10):
        pool._event(True, bytes([i]))
    assert pool.events_dropped > 0 and len(pool.events) == 8


def test_prefix_index_match():
    from flowrt.replicas.index import PrefixIndex

    idx = PrefixIndex(block_size=4)
    ids = list(range(1, 20))
    hs = idx.hashes(ids)
    assert len(hs) == 4
    idx.add(0, hs[:2])
    idx.add(1, hs)
    assert idx.match(hs, [0, 1]) == {0: 2, 1: 4}
    idx.remove(1, hs[1:2])  # a hole: only the leading run counts
    assert idx.match(hs, [0, 1]) == {0: 2, 1: 1}
    idx.clear(0)
    assert idx.match(hs, [0, 1]) == {0: 0, 1: 1}


@pytest.mark.slow  # a fresh interpreter importing the runtime and the CLI
def test_single_process_never_imports_ray():
    import subprocess
    import sys

    code = ("import sys, flowrt as fr, flowrt.runner.runtime, flowrt.cli.commands, flowrt.replicas\n"
            "fr.Runtime('x'); flowrt.cli.commands.build_parser()\n"
            "assert 'ray' not in sys.modules, 'ray was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_cli_replica_flags():
    from flowrt.cli.commands import build_parser, engine_kwargs_from_args, replica_kwargs_from_args

    args = build_parser().parse_args(["run", "wf.py", "--replicas", "2", "--routing", "round_robin"])
    assert replica_kwargs_from_args(args) == {"replicas": 2, "ray_address": None, "routing": "round_robin"}
    assert "replicas" not in engine_kwargs_from_args(args)
    assert replica_kwargs_from_args(build_parser().parse_args(["run", "wf.py"])) == {}
    serve = build_parser().parse_args(["serve", "--replicas", "3", "--ray-address", "auto"])
    assert (serve.replicas, serve.ray_address, serve.routing) == (3, "auto", "prefix")


ray = pytest.importorskip("ray", reason="flowrt.replicas needs ray (pip install 'flowrt[ray]')")
pytestmark = pytest.mark.timeout(300)  # a hang (a replica that never answers) fails the test, not CI
SLOW_FIXTURES = {"ray_instance"}  # tests that start Ray are `slow` (tests/conftest.py)


@pytest.fixture(scope="module")
def ray_instance():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def rt(ray_instance, stories_path):
    runtime = fr.Runtime(stories_path, replicas=2, max_model_len=512,
                         replica_options={"poll_interval": 0.05, "load_abs": 4, "load_rel": 1.5, "max_restarts": 2})
    asyncio.run(runtime.model())  # starts the replicas
    yield runtime
    runtime.close()


def make_wf(max_tokens: int = 16, retries: int = 0, name: str = "rep"):
    wf = fr.Workflow(name)

    @wf.step
    async def context(system: str, llm: fr.Model) -> fr.Thread:
        t = llm.thread(system)
        await t.gen(max_tokens=1, temperature=0)  # opened (and computed) on the run's replica in this step
        return t

    @wf.step(retries=retries)
    async def answer(context: fr.Thread, question: str, llm: fr.Model) -> dict:
        t = context + question
        outs = await fr.gather(*(s.gen(max_tokens=max_tokens, temperature=0, ignore_eos=True) for s in t.fork(2)))
        one = await llm.generate(question, max_tokens=8, temperature=0)
        pick = await (context + " Was it").select([" big", " small"])  # prompt logprobs over forks
        streamed = "".join([p async for p in (context + question).stream(max_tokens=6, temperature=0)])
        eng = llm.engine  # a RunClient on replicas; the AsyncLLM itself in the single-process runtime
        replica = getattr(eng, "replica", None)
        return {"outs": outs, "one": one, "pick": pick, "streamed": streamed,
                "replica": replica.index if replica is not None else None,
                "history": list(getattr(eng, "history", ()))}

    return wf


def run_all(rt, wf, inputs: list[dict]):
    async def go():
        return await asyncio.gather(*(rt.run(wf, **kw) for kw in inputs))

    return asyncio.run(go())


def rs_of(rt):
    return rt.llm.engine.replica_set


def test_affinity_and_greedy_parity(rt, stories_path):
    wf = make_wf()
    inputs = [{"system": s, "question": q} for s in (SYSTEM_A, SYSTEM_B) for q in (" She", " The dog")]
    results = run_all(rt, wf, inputs)
    for r in results:
        assert r.ok, r.errors
        out = r.outputs["answer"]
        assert out["history"] and set(out["history"]) == {out["replica"]}  # every request of the run: one replica
    with fr.Runtime(stories_path, max_model_len=512) as single:
        expected = run_all(single, wf, inputs)
    assert all(e.ok for e in expected), [e.errors for e in expected]
    for r, e in zip(results, expected):
        assert r.outputs["answer"]["outs"] == e.outputs["answer"]["outs"]
        for key in ("one", "pick", "streamed"):
            assert r.outputs["answer"][key] == e.outputs["answer"][key], key


def test_replicas_get_their_share_of_cores(rt):
    import os

    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("pinning needs sched_setaffinity and two cores")
    rs = rs_of(rt)
    cores = [h.cores for h in rs.replicas]
    assert all(c is not None for c in cores), cores  # one node, 2 cpus for 2 replicas: each is pinned
    assert not set(cores[0]) & set(cores[1]) and all(len(c) == 1 for c in cores)


def test_prefix_routing(rt):
    rs = rs_of(rt)
    wf = make_wf(max_tokens=4)
    indexed, reported = threading.Condition(), set()  # replicas whose cache events the poller applied

    def notify(update):
        def wrapped(replica, *a, **kw):
            update(replica, *a, **kw)
            if threading.current_thread().name == "flowrt-replica-poller":  # not the router's prediction
                with indexed:
                    reported.add(replica)
                    indexed.notify_all()
        return wrapped

    rs.index.add, rs.index.replace = notify(rs.index.add), notify(rs.index.replace)
    try:
        first = run_all(rt, wf, [{"system": SYSTEM_A + "Lily smiled. ", "question": " Q0"}])[0]
        home = first.outputs["answer"]["replica"]
        with indexed:  # the home replica's cache events reach the index
            assert indexed.wait_for(lambda: home in reported, timeout=60)
        assert rs.index.size(home) > 0
    finally:
        del rs.index.add, rs.index.replace
    # Three concurrent runs with forks can put more than load_abs (4) requests on the home replica, and then the
    # router rightly spills one by load (test_load_fallback covers that): this test is about prefix routing alone.
    load_abs, rs.router.load_abs = rs.router.load_abs, 1000
    try:
        results = run_all(rt, wf, [{"system": SYSTEM_A + "Lily smiled. ", "question": f" Q{i}"} for i in range(1, 4)])
    finally:
        rs.router.load_abs = load_abs
    assert [r.outputs["answer"]["replica"] for r in results] == [home] * 3
    assert all(r.stats["run_prefix_cache_hit_tokens"] > 0 for r in results)  # the shared system prompt, cached
    assert rs.router.counters["routed_prefix"] >= 3


def test_load_fallback(rt):
    rs = rs_of(rt)
    router = rs.router
    ids = rt.llm.tokenizer(SYSTEM_B + "Max barked.")["input_ids"]
    home = router.pick(ids)
    assert router.pick(ids) is home  # cached (predicted) there
    other = next(h for h in rs.replicas if h is not home)
    home.runs += 10  # home is overloaded: beyond load_abs (4) and load_rel (1.5x) of the least loaded
    try:
        before = router.counters["routed_load"]
        assert router.pick(ids) is other
        assert router.counters["routed_load"] == before + 1
    finally:
        home.runs -= 10


def test_round_robin_policy(rt):
    router = rs_of(rt).router
    router.routing = "round_robin"
    try:
        picks = [router.pick([1, 2, 3]).index for _ in range(4)]
    finally:
        router.routing = "prefix"
    assert sorted(picks) == [0, 0, 1, 1]


def test_router_is_an_engine_client_behind_the_server(rt, stories_path):
    """`flowrt serve --replicas N`: the router is the server's engine; /metrics shows each replica."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from flowrt.engine.interfaces import EngineClient
    from flowrt.replicas.client import RouterClient
    from flowrt.server.app import create_app
    from flowrt.server.background import BackgroundServer

    engine = RouterClient(rs_of(rt))
    assert isinstance(engine, EngineClient)
    with BackgroundServer(create_app(engine, model_path=stories_path)) as srv:
        body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        chunks = []
        with httpx.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
            assert s.status_code == 200
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(line)
        assert chunks
        bad = httpx.post(f"{srv.url}/v1/completions", json={**body, "max_tokens": 100000}, timeout=60)
        assert bad.status_code == 400
        metrics = httpx.get(f"{srv.url}/metrics", timeout=60).text
    assert 'flowrt_replica_healthy{node=' in metrics or 'flowrt_replica_healthy{replica=' in metrics
    assert metrics.count("flowrt_replica_load{") == 2


def test_replica_given_up_on_comes_back_in_a_new_epoch(rt):
    """The poller gives a replica up when it does not answer in time (a loaded machine), dropping what was queued
    for it (here a thread's append); when it answers again it is taken back in a new epoch, so that the thread is
    restored from its token ids instead of generating from its stale copy there, which is closed."""
    from flowrt.engine import SamplingParams

    rs = rs_of(rt)
    client = rt.llm.engine.bind()
    h = rs.replicas[1]   # not the death test's victim (it counts that one's restarts)
    client._bind_to(h)
    seq = client.open(rs.tokenizer(SYSTEM_A)["input_ids"])
    asyncio.run(client.generate(seq, SamplingParams(max_tokens=1, temperature=0)))
    seq.append(rs.tokenizer(" Then a big dog came and barked at the moon.")["input_ids"])   # queued for h
    old, sid, tokens = h.epoch, seq.sid, seq.token_ids
    rs.mark_dead(h, "GetTimeoutError: state() did not answer in 10 s", old)   # what the poller does then
    deadline = time.monotonic() + 60
    while not h.healthy and time.monotonic() < deadline:
        time.sleep(0.05)
    assert h.healthy
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    out = asyncio.run(client.generate(seq, params))
    expected = asyncio.run(client.generate({"prompt_token_ids": tokens}, params))
    client.release()
    assert list(out.outputs[0].token_ids) == list(expected.outputs[0].token_ids)   # the append is in its context
    assert h.epoch != old
    assert ray.get(h.actor.seq_tokens.remote(sid)) is None   # its stale copy is not left holding KV there


def test_sqlite_run_taken_over_when_its_replica_dies(ray_instance, stories_path, tmp_path):
    """One node, SQLite: a replica killed mid-run leaves its checkpointed runs to the other replica, which
    continues each from its last checkpoint (the finished steps are not run again) to the same greedy output."""
    import collections

    finished: collections.Counter = collections.Counter()
    wf = fr.Workflow("takeover")

    @wf.step
    async def context(system: str, tag: str, llm: fr.Model) -> fr.Thread:
        t = llm.thread(system)
        await t.gen(max_tokens=1, temperature=0)
        finished[(tag, "context")] += 1
        return t

    @wf.step
    async def answer(context: fr.Thread, tag: str, llm: fr.Model) -> dict:
        text = await (context + f" {tag}").gen(max_tokens=200, temperature=0, ignore_eos=True)
        finished[(tag, "answer")] += 1
        return {"text": text, "replica": llm.engine.replica.index}

    runtime = fr.Runtime(stories_path, replicas=2, max_model_len=512, checkpoint=str(tmp_path / "runs.db"),
                         routing="round_robin",
                         replica_options={"poll_interval": 0.05, "num_cpus_per_replica": 0, "max_restarts": 1})
    try:
        asyncio.run(runtime.model())
        rs = runtime.llm.engine.replica_set
        victim = rs.replicas[0]

        async def go():
            tasks = [asyncio.create_task(runtime.run(wf, system=SYSTEM_A, tag=f"t{i}")) for i in range(4)]
            deadline = time.monotonic() + 60
            while victim.in_flight < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            ray.kill(victim.actor, no_restart=False)
            return await asyncio.gather(*tasks)

        results = asyncio.run(go())
        assert all(r.ok for r in results), [r.errors for r in results]
        taken = [r for r in results if r.stats.get("takeovers")]
        assert len(taken) == 2 and all(r.outputs["answer"]["replica"] == 1 for r in taken)
        for r in taken:   # the takeover's own prompt tokens; the run's count its first attempt's calls too
            assert 0 < r.stats["takeover_tokens_computed"] <= r.stats["run_tokens_computed"], r.stats
        assert set(finished.values()) == {1} and len(finished) == 8   # every step of every run finished once
        for r in taken:   # the same greedy text as a run that no death interrupted
            tag = runtime.checkpointer.get_run(r.run_id, with_state=False).inputs["tag"]
            assert runtime.checkpointer.get_run(r.run_id, with_state=False).status == "done"
            again = asyncio.run(runtime.run(wf, system=SYSTEM_A, tag=tag))
            assert again.outputs["answer"]["text"] == r.outputs["answer"]["text"]
    finally:
        runtime.close()


def test_replica_death_fails_only_its_runs_and_comes_back(rt):
    rs = rs_of(rt)
    router = rs.router
    router.routing = "round_robin"  # one run per replica, whatever the caches hold
    victim = rs.replicas[0]
    old_pid = victim.pid
    plain, retried = make_wf(max_tokens=300, name="plain"), make_wf(max_tokens=300, retries=1, name="retried")

    async def go():
        tasks = [asyncio.create_task(rt.run(plain, system=SYSTEM_A, question=" One")),
                 asyncio.create_task(rt.run(plain, system=SYSTEM_B, question=" Two"))]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(rt.run(retried, system=SYSTEM_A, question=" Three")),
                  asyncio.create_task(rt.run(retried, system=SYSTEM_B, question=" Four"))]
        deadline = time.monotonic() + 60
        while victim.in_flight < 4 and time.monotonic() < deadline:  # both of its runs are generating
            await asyncio.sleep(0.005)
        ray.kill(victim.actor, no_restart=False)
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(go())
    finally:
        router.routing = "prefix"
    died = [r for r in results if not r.ok]
    assert len(died) == 1, [r.errors for r in results]  # the plain run on the victim
    msg = died[0].errors["answer"].message
    assert "ReplicaDiedError" in msg and "replica 0" in msg
    ok_retried = [r for r in results if r.ok and r.workflow == "retried"]
    assert len(ok_retried) == 2
    assert all(r.outputs["answer"]["replica"] == 1 for r in ok_retried)  # the retry ran on the survivor
    # Ray restarts the actor and the router takes it back.
    deadline = time.monotonic() + 120
    while not (victim.healthy and victim.restarts >= 1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert victim.healthy and victim.restarts == 1 and victim.pid != old_pid
    router.routing = "round_robin"
    try:
        again = run_all(rt, make_wf(max_tokens=4), [{"system": SYSTEM_A, "question": f" Q{i}"} for i in range(2)])
    finally:
        router.routing = "prefix"
    assert all(r.ok for r in again) and {r.outputs["answer"]["replica"] for r in again} == {0, 1}


def test_missing_model_path_fails_clearly(ray_instance, tmp_path):
    from flowrt.replicas.client import ReplicaSet

    with pytest.raises(RuntimeError, match=r"replica 0: the model path .*nope.* does not exist on node"):
        ReplicaSet(str(tmp_path / "nope"), 1, max_restarts=0, num_cpus_per_replica=0)
