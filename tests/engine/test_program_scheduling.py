"""Program-aware scheduling and KV retention (engine/request/program.py, engine/core/scheduler.py "program" policy).

Random agent-like programs (runs of threads that generate, wait on a pretend tool for some steps, append
and generate again, sometimes fork) run under both policies on a small KV pool: greedy outputs are the
same, nothing leaks, and under "program" no request waits past the starvation bound. A unit test shows the
case the policy exists for: LRU hands a tool-waiting thread's KV to a new request and the thread
recomputes it when it returns; the program policy keeps it.
"""

import asyncio
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowrt.engine import AsyncLLM, EngineArgs, LLMEngine, ProgramContext, SamplingParams
from flowrt.engine.kv.block_pool import BlockPool
from flowrt.engine.request.program import ProgramTracker, as_program_context

BS = 8
BLOCKS = 32
MAX_WAIT = 6


@pytest.fixture(scope="module")
def engines(stories_path):
    kw = dict(model=stories_path, dtype="float32", num_kv_blocks=BLOCKS, block_size=BS, max_num_batched_tokens=64)
    return {p: LLMEngine(**kw, scheduling_policy=p, max_wait_steps=MAX_WAIT) for p in ("fcfs", "program")}


def _greedy(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _run_program(eng: LLMEngine, runs: list[dict]) -> dict:
    """Drives `runs` step by step (a turn's next request is issued `tool` steps after its last ended).

    Returns {(run, turn, branch): generated token ids}; checks the starvation bound after every step
    under the program policy."""
    sched = eng.scheduler
    outs: dict = {}
    state = [dict(seq=None, turn=0, ready=r["start"], reqs=[], done=False) for r in runs]
    worst_wait = 0
    for step in range(2000):
        for i, (r, s) in enumerate(zip(runs, state)):
            if s["done"] or s["reqs"] or step < s["ready"]:
                continue
            if s["turn"] == len(r["turns"]):
                eng.close(s["seq"])
                s["done"] = True
                continue
            append, max_tokens, _, fork = r["turns"][s["turn"]]
            ctx = ProgramContext(run_id=f"run{i}", step="react", thread_id=i)
            if s["seq"] is None:
                s["seq"] = eng.open(r["prompt"], program=ctx)
            else:
                eng.append(s["seq"], append)
            seqs = [s["seq"]] + (eng.fork(s["seq"], 1) if fork else [])
            s["reqs"] = [(b, seq, eng.add_request(seq, _greedy(max_tokens), program=ctx)) for b, seq in enumerate(seqs)]
        if all(s["done"] for s in state):
            break
        eng.step()
        if sched.program:
            waits = [sched.step_no - q.sched.enqueued_step for q in sched.waiting]
            worst_wait = max([worst_wait] + waits)
        for i, (r, s) in enumerate(zip(runs, state)):
            if s["reqs"] and all(req.finished for _, _, req in s["reqs"]):
                for b, seq, req in s["reqs"]:
                    outs[(i, s["turn"], b)] = eng.make_output(req).outputs[0].token_ids
                    if b:
                        eng.close(seq)  # the branch is done; the run continues on its main thread
                s["ready"] = step + 1 + r["turns"][s["turn"]][2]
                s["turn"] += 1
                s["reqs"] = []
    else:
        raise AssertionError("the program did not finish")
    return {"outs": outs, "worst_wait": worst_wait}


_tokens = st.lists(st.integers(3, 500), min_size=1, max_size=8)
_turn = st.tuples(_tokens, st.integers(1, 8), st.integers(0, 6), st.booleans())
_run = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(3, 500), min_size=2, max_size=20),
    "start": st.integers(0, 6),
    "turns": st.lists(_turn, min_size=1, max_size=3),
})


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(runs=st.lists(_run, min_size=1, max_size=5), shared=st.lists(st.integers(3, 500), min_size=0, max_size=12))
def test_random_programs_same_outputs_no_leaks_bounded_waits(engines, runs, shared):
    for r in runs:  # a shared system prompt, as agent runs have
        r["prompt"] = [1] + shared + r["prompt"]
    results = {}
    for policy, eng in engines.items():
        results[policy] = _run_program(eng, runs)
        st_ = eng.stats()
        assert st_["kv_blocks_used"] == 0, f"{policy}: blocks leaked"
        assert st_["open_sequences"] == 0 and st_["num_running"] == 0 and st_["num_waiting"] == 0
        eng.pool.check_invariants()
        assert eng.pool.num_free == BLOCKS
        eng.reset_prefix_cache()
    assert results["fcfs"]["outs"] == results["program"]["outs"]
    # Starved sequences go before all other work and may preempt it; the pool holds at least two of the
    # largest requests, so one starved request waits at most one more request's lifetime (<= 8 tokens +
    # its prompt chunks) behind another starved one.
    assert results["program"]["worst_wait"] <= MAX_WAIT + 12


def _tool_waiting_scenario(stories_path, policy):
    """Thread A (run a) generates and waits on a tool; C runs; B, a new run, arrives needing more KV than
    is free; A's tool returns while C still runs. Returns (engine, A's outputs)."""
    eng = LLMEngine(model=stories_path, dtype="float32", num_kv_blocks=16, block_size=8, scheduling_policy=policy)
    rng = random.Random(1)
    a = eng.open([1] + [rng.randrange(3, 500) for _ in range(47)], program=ProgramContext("a", "agent", "t0"))
    r = eng.add_request(a, _greedy(1))
    while not r.finished:
        eng.step()
    assert a.sched.program.state.value == "waiting"  # between calls: the engine marks it waiting
    c = eng.add_request({"prompt_token_ids": [1] + [rng.randrange(3, 500) for _ in range(23)]}, _greedy(30),
                        program="c")
    b = eng.add_request({"prompt_token_ids": [1] + [rng.randrange(3, 500) for _ in range(95)]}, _greedy(4),
                        program=ProgramContext("b", "agent", "t0"))
    for _ in range(3):
        eng.step()
    eng.append(a, [rng.randrange(3, 500) for _ in range(8)])  # the tool's result
    ra = eng.add_request(a, _greedy(4), program=ProgramContext("a", "agent", "t0"))
    while not (ra.finished and b.finished and c.finished):
        eng.step()
    outs = [eng.make_output(x).outputs[0].token_ids for x in (ra, b, c)]
    eng.close(a)
    assert eng.stats()["kv_blocks_used"] == 0
    return eng, outs


def test_lru_evicts_a_tool_waiting_thread_program_policy_keeps_it(stories_path):
    lru, lru_outs = _tool_waiting_scenario(stories_path, "fcfs")
    prog, prog_outs = _tool_waiting_scenario(stories_path, "program")
    assert lru_outs == prog_outs  # the same greedy tokens either way
    ls, ps = lru.stats(), prog.stats()
    # LRU: B's admission took A's idle KV; A recomputed (most of) its 48 tokens when its tool returned.
    assert lru.run_stats("a")["prefill_tokens_recomputed"] >= 32
    assert ls["prefill_tokens_recomputed"] >= 32 and ls["kv_evicted_in_use_later"] >= 4
    # program: A kept its KV while it waited; B ran once memory was free.
    assert prog.run_stats("a")["prefill_tokens_recomputed"] == 0
    assert ps["prefill_tokens_recomputed"] == 0 and ps["kv_evicted_in_use_later"] == 0
    assert ps["prefill_tokens_computed"] < ls["prefill_tokens_computed"]
    runs = prog.run_stats()
    assert set(runs) >= {"a", "b", "c"}
    assert runs["a"]["requests"] == 2 and runs["a"]["service_tokens"] > 0
    # B queued for steps until memory was free; C was admitted in the step it arrived
    assert runs["b"]["queue_time_s"] > runs["c"]["queue_time_s"] > 0


def test_finished_threads_are_released_before_waiting_ones(stories_path):
    eng = LLMEngine(model=stories_path, dtype="float32", num_kv_blocks=12, block_size=8, scheduling_policy="program")
    seqs = []
    for i in range(3):
        s = eng.open([1] + [10 + i] * 23, program=ProgramContext(f"r{i}", "s", i))
        r = eng.add_request(s, _greedy(1))
        while not r.finished:
            eng.step()
        seqs.append(s)
    eng.set_program(seqs[0], state="waiting")
    eng.set_program(seqs[1], state="finished")  # its step ended: its KV goes first
    # LRU would take seqs[0] (idle longest); the program policy takes the finished thread
    new = eng.open([1] + [99] * 30)
    r = eng.add_request(new, _greedy(2))
    while not r.finished:
        eng.step()
    eng.close(new)
    assert seqs[1].kv.num_computed_tokens == 0
    assert seqs[0].kv.num_computed_tokens == 24 and seqs[2].kv.num_computed_tokens == 24
    for s in seqs:
        eng.close(s)
    assert eng.stats()["kv_blocks_used"] == 0


def test_program_context_api_and_validation(stories_path):
    assert as_program_context(None) is None
    assert as_program_context("run-7") == ProgramContext(run_id="run-7")
    assert as_program_context({"run_id": "r", "state": "waiting"}).state.value == "waiting"
    with pytest.raises(ValueError, match="program state"):
        ProgramContext("r", state="sleeping")
    with pytest.raises(ValueError, match="unknown program context"):
        as_program_context({"run": "r"})
    with pytest.raises(ValueError):
        EngineArgs(scheduling_policy="lifo")
    assert EngineArgs().scheduling_policy == "program"

    async def main():
        async with AsyncLLM(stories_path, dtype="float32", num_kv_blocks=32, block_size=8) as engine:
            seq = engine.open([1, 5, 6, 7], program={"run_id": "r1", "step": "plan", "thread_id": 3})
            out = await engine.generate(seq, _greedy(3), program=ProgramContext("r1", "plan", 3))
            assert len(out.outputs[0].token_ids) == 3
            assert seq.program.state.value == "waiting"
            seq.set_state("finished", step="act")
            assert seq.program.state.value == "finished" and seq.program.step == "act"
            plain = await engine.generate("Once upon a time", _greedy(2))  # no context: works as before
            assert plain.outputs[0].finish_reason == "length"
            chunks = [o async for o in engine.stream("Once", _greedy(2), program="r2")]
            assert chunks[-1].finished
            runs = engine.run_stats()
            assert runs["r1"]["requests"] == 1 and runs["r1"]["service_tokens"] >= 6 and "r2" in runs
            assert engine.run_stats("nope") is None
            s = engine.stats()
            assert {"prefill_tokens_recomputed", "kv_evicted_in_use_later"} <= set(s)
            seq.close()

    asyncio.run(main())


def test_pool_low_priority_and_protected_blocks():
    pool = BlockPool(4)
    ids = [pool.allocate() for _ in range(3)]
    for i, bid in enumerate(ids):
        pool.register(bid, bytes([i]) * 16)
    pool.decref(ids[0])  # normal, released first
    pool.decref(ids[1], low_priority=True)  # a closed thread's: evicted before the normal ones
    pool.decref(ids[2])
    pool.set_protected({bytes([0]) * 16})  # queued work needs block 0's prefix
    pool.allocate()  # the never-used block
    assert pool.allocate() == ids[1]
    assert pool.allocate() == ids[2]  # block 0 is older but protected
    assert bytes([1]) * 16 in pool.evicted_hashes
    pool.check_invariants()


def test_wait_estimate_prefers_evicting_the_farthest_return():
    t = ProgramTracker()
    for g in (0.1, 0.2, 0.3, 0.4, 0.5):
        t.observe_gap(g)
    # uniform tool times: a thread that just started waiting returns last; one near the end returns soon
    assert t.expected_return_s(0.0) > t.expected_return_s(0.35) > 0
    assert not t.overdue(0.6) and t.overdue(1.5)
    assert t.expected_return_s(2.0) >= 2.0  # past every gap seen: the longest waiting go first


def _sched_with(policy):
    from flowrt.engine.kv.cache_manager import KVCacheManager
    from flowrt.engine.core.scheduler import Scheduler

    kv = KVCacheManager(BlockPool(32), 4)
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, policy=policy)


def _step_until_idle(sched, seq):
    """Computes seq's pending tokens (no model: the block-manager tests' way) and parks it."""
    while seq.kv.num_computed_tokens < seq.num_tokens:
        batch = sched.schedule()
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            sched.kv.mark_computed(s, n)
    sched.finish(seq)


@pytest.mark.parametrize("policy", ["fcfs", "program"])
def test_admission_reserves_room_for_the_growth_of_resident_threads(policy):
    """Three threads of step "react" are resident: two long ones (40 tokens; one running, one waiting on a
    tool) and a short one (8 tokens, waiting) that will grow to about their length. A new thread of the same
    step arrives while 10 blocks are free: it fits now, but its growth and the short thread's would later
    take a waiting thread's KV. The program policy keeps it out, and admits it once a long thread closes;
    fcfs admits it at once. Before the reservation, program admitted it too (nothing closed yet to learn
    from)."""
    from flowrt.engine.request.sequence import Sequence

    sched = _sched_with(policy)
    threads = []
    for i, n in enumerate((8, 40, 40)):
        t = Sequence(list(range(100 * (i + 1), 100 * (i + 1) + n)), persistent=True)
        sched.set_program(t, ProgramContext(f"r{i}", "react", i))
        sched.add(t)
        _step_until_idle(sched, t)
        threads.append(t)
    short, long, _ = threads
    long.append(7)  # its next request: one token to decode
    sched.add(long)
    new = Sequence(list(range(900, 908)), persistent=True)
    sched.set_program(new, ProgramContext("r9", "react", 9))
    sched.add(new)
    assert sched.kv.pool.num_free == 10
    batch = sched.schedule()
    assert (new in batch.seqs) == (policy == "fcfs")
    assert all(t.kv.block_table for t in threads), "the resident threads keep their KV"
    if policy == "program":
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            sched.kv.mark_computed(s, n)
        sched.finish(long)
        sched.close(long)
        assert new in sched.schedule().seqs  # room again: admitted
