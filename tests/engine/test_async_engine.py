"""AsyncLLM: concurrent callers, streaming, abort, bad requests isolated, open sequences."""

import asyncio

import pydantic
import pytest

from flowrt.engine import AsyncLLM, SamplingParams


@pytest.fixture(scope="module")
def engine(stories_path):
    eng = AsyncLLM(stories_path, dtype="float32")
    yield eng
    eng.shutdown()


def run(coro):
    return asyncio.run(coro)


def test_concurrent_requests_match_sequential(engine):
    prompts = ["Once upon a time", "The dog", "Lily went to the park and", "A big red ball"]
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    async def main():
        together = await asyncio.gather(*(engine.generate(x, p) for x in prompts))
        alone = [await engine.generate(x, p) for x in prompts]
        return together, alone

    together, alone = run(main())
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    assert engine.stats()["kv_blocks_used"] == 0


def test_streaming_is_cumulative_and_ends_finished(engine):
    async def main():
        snaps = []
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        async for out in engine.stream("Once upon a time", params):
            snaps.append((list(out.outputs[0].token_ids), out.outputs[0].text, out.finished))
        return snaps

    snaps = run(main())
    assert snaps[-1][2] and not any(f for _, _, f in snaps[:-1])
    lens = [len(t) for t, _, _ in snaps]
    assert lens == sorted(lens) and lens[-1] == 8
    assert all(snaps[-1][1].startswith(txt) for _, txt, _ in snaps)


def test_bad_request_is_rejected_alone(engine):
    async def main():
        good = asyncio.create_task(
            engine.generate("Once upon a time", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)))
        await asyncio.sleep(0.01)
        with pytest.raises(ValueError, match="empty"):
            await engine.generate("", SamplingParams(max_tokens=3))
        with pytest.raises(ValueError, match="max_model_len"):
            engine.stream({"prompt_token_ids": [1] * 5000}, SamplingParams(max_tokens=3))  # raises before iterating
        with pytest.raises(pydantic.ValidationError):
            await engine.generate("x", SamplingParams(temperature=-3))
        return await good

    out = run(main())
    assert len(out.outputs[0].token_ids) == 20


def test_abort_and_cancellation_release_blocks(engine):
    async def main():
        params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        got = []

        async def consume():
            async for out in engine.stream("Once upon a time", params, request_id="to-abort"):
                got.append(out)

        task = asyncio.create_task(consume())
        while not got:
            await asyncio.sleep(0.01)
        engine.abort("to-abort")
        await task
        assert got[-1].finished and got[-1].outputs[0].finish_reason == "abort"
        # a caller that goes away (task cancelled) aborts its request too
        t2 = asyncio.create_task(engine.generate("The dog", params))
        await asyncio.sleep(0.05)
        t2.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t2
        for _ in range(100):
            if engine.stats()["kv_blocks_used"] == 0 and engine.stats()["num_running"] == 0:
                break
            await asyncio.sleep(0.02)

    run(main())
    s = engine.stats()
    assert s["kv_blocks_used"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0


def test_open_sequences_from_async_callers(engine):
    async def main():
        tok = engine.tokenizer
        seq = engine.open(tok("Once upon a time").input_ids)
        await engine.generate(seq, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        n0 = len(seq)
        kids = seq.fork(4)
        outs = await asyncio.gather(
            *(engine.generate(k, SamplingParams(max_tokens=6, temperature=1.0, seed=i, ignore_eos=True))
              for i, k in enumerate(kids)))
        assert all(len(k) == n0 + 6 for k in kids) and len(seq) == n0
        assert all(k.token_ids[:n0] == seq.token_ids for k in kids)
        with pytest.raises(ValueError, match="n must be 1"):
            await engine.generate(seq, SamplingParams(n=2))
        del kids, outs  # garbage collection closes the sequences
        seq.close()
        seq.close()  # idempotent
        with pytest.raises(ValueError, match="closed"):
            await engine.generate(seq, SamplingParams(max_tokens=1))

    run(main())
    import gc

    gc.collect()
    s = engine.stats()
    assert s["open_sequences"] == 0 and s["kv_blocks_used"] == 0


def test_new_submission_errors_raise_from_stream_before_iterating(engine):
    import numpy as np

    cap = engine.stats()["num_kv_blocks"] * engine.stats()["block_size"]

    async def main():
        with pytest.raises(ValueError, match="empty"):
            engine.stream([], SamplingParams(max_tokens=3))
        with pytest.raises(ValueError, match="seed"):
            engine.stream("Once", {"seed": -5})
        with pytest.raises(ValueError, match="stop_token_ids"):
            engine.stream("Once", SamplingParams(max_tokens=3, stop_token_ids=[-1]))
        big = SamplingParams(max_tokens=cap, ignore_eos=True)
        if engine.max_model_len > cap:
            with pytest.raises(ValueError, match="more than the KV cache holds"):
                engine.stream("Once", big)
        ids = engine.tokenizer("Once upon a time").input_ids
        p = SamplingParams(max_tokens=4, temperature=0)
        a = await engine.generate(np.array(ids), p)
        b = await engine.generate(ids, p)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids

    run(main())
    assert engine.stats()["num_waiting"] == 0 and engine.stats()["num_running"] == 0


def test_sequence_of_another_engine_is_refused(engine, stories_path):
    other = AsyncLLM(stories_path, dtype="float32")
    try:
        async def main():
            seq = other.open(engine.tokenizer("Once upon a time").input_ids)
            with pytest.raises(ValueError, match="another engine"):
                engine.stream(seq, SamplingParams(max_tokens=3, temperature=0))
            with pytest.raises(ValueError, match="another engine"):
                await engine.generate(seq, SamplingParams(max_tokens=3, temperature=0))
            out = await other.generate(seq, SamplingParams(max_tokens=3, temperature=0))
            assert len(out.outputs[0].token_ids) == 3
            seq.close()

        run(main())
    finally:
        other.shutdown()
    assert engine.stats()["num_waiting"] == 0 and engine.stats()["open_sequences"] == 0


def test_engine_failure_reaches_callers_as_the_error(engine):
    """A broken step fails requests in flight through their error path (on_error), never as an output."""
    eng = engine.engine
    orig = eng.runner.execute

    def boom(inputs):
        raise RuntimeError("injected step failure")

    async def main():
        eng.runner.execute = boom
        try:
            with pytest.raises(RuntimeError, match="injected step failure"):
                await engine.generate("Once upon a time", SamplingParams(max_tokens=5))
        finally:
            eng.runner.execute = orig
        out = await engine.generate("Once upon a time", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 3

    run(main())
    assert engine.stats()["kv_blocks_used"] == 0 and engine.stats()["num_running"] == 0


def test_engine_is_built_on_the_thread_that_steps_it(stories_path, monkeypatch):
    """Every OpenMP region must start on one thread: a second thread's team makes libgomp's workers sleep between
    regions (built on the caller's thread, the server decoded 1.7x slower on 2 cores)."""
    import threading

    from flowrt.engine import async_llm

    seen: dict[str, set[int]] = {"init": set(), "step": set()}
    real_init, real_step = async_llm.LLMEngine.__init__, async_llm.LLMEngine.step

    def init(self, *a, **k):
        seen["init"].add(threading.get_ident())
        real_init(self, *a, **k)

    def step(self, *a, **k):
        seen["step"].add(threading.get_ident())
        return real_step(self, *a, **k)

    monkeypatch.setattr(async_llm.LLMEngine, "__init__", init)
    monkeypatch.setattr(async_llm.LLMEngine, "step", step)
    eng = AsyncLLM(stories_path, dtype="float32")
    try:
        run(eng.generate("Once upon a time", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)))
    finally:
        eng.shutdown()
    assert seen["init"] == seen["step"] == {eng._thread.ident}
    assert threading.get_ident() not in seen["init"]


def test_a_bad_engine_argument_raises_in_the_callers_thread(stories_path, tmp_path):
    with pytest.raises(pydantic.ValidationError):
        AsyncLLM(stories_path, dtype="float13")
    with pytest.raises(Exception, match="does-not-exist"):
        AsyncLLM(str(tmp_path / "does-not-exist"), dtype="float32")


def test_kv_copies_on_the_callers_thread_release_its_openmp_team(engine, monkeypatch):
    import threading

    from flowrt.engine import async_llm

    calls: list[int] = []
    monkeypatch.setattr(async_llm, "release_openmp_team", lambda: calls.append(threading.get_ident()) or True)
    ids = engine.tokenizer.encode("Once upon a time there was a little girl named Lily")
    run(engine.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0)))
    blocks = engine.kv_export(ids)
    engine.kv_import(blocks)
    assert calls == [threading.get_ident()] * 2
