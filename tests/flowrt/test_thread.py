"""Threads on the real engine (stories260K, a tiny Llama): tokenization, gen, fork semantics and KV
sharing, select, streaming, release of blocks, and chat byte-stability (tiny random Llama + ChatML)."""

from __future__ import annotations

import time
import uuid

import anyio
import pytest

import flowrt as fr
from support import STORIES, leak_checked_model

MODEL = str(STORIES)

pytest.importorskip("flowrt.engine")


@pytest.fixture()
def llm(engine):
    yield from leak_checked_model(engine)


def stats_delta(engine, before):
    after = engine.stats()
    return {k: after[k] - before[k] for k in ("prefill_tokens_computed", "prompt_tokens", "generated_tokens",
                                              "cow_copies", "prefix_cache_hit_tokens")}


def unique_prompt(n_words: int = 40) -> str:
    # A fresh prompt per test, so the prefix cache of earlier tests cannot help.
    tag = uuid.uuid4().hex[:8]
    words = "the little dog ran to the big red ball and sat down by the tree".split()
    return f"Tale {tag}: " + " ".join(words[i % len(words)] for i in range(n_words))


# ------------------------------------------------------------------------------------- tokenization
def test_pieces_tokenize_like_the_whole_text(llm):
    tok = llm.tokenizer
    t = llm.thread("Once upon a time")
    t += ", there was"
    t += " a little girl"
    assert t.token_ids == tok("Once upon a time, there was a little girl")["input_ids"]
    assert t.text == "Once upon a time, there was a little girl"
    # a word-start piece after committed tokens gets no extra SentencePiece "▁"
    world = llm.encode(" world")
    assert world == tok("Hello world", add_special_tokens=False)["input_ids"][-len(world):]
    assert llm.encode("world", first=True) == [tok.bos_token_id] + tok("world", add_special_tokens=False)["input_ids"]
    t.close()


def test_gen_appends_and_returns_text_without_stop(llm, engine):
    async def main():
        t = llm.thread("Once upon a time")
        out = await t.gen(max_tokens=12, temperature=0)
        assert out and t.text == "Once upon a time" + out
        n = len(t.token_ids)
        # the same greedy continuation as a one-shot engine call
        from flowrt.engine import SamplingParams

        ref = await engine.generate("Once upon a time", SamplingParams(max_tokens=12, temperature=0))
        assert out == ref.outputs[0].text
        # stop strings: excluded from the returned text, kept in the thread
        s = llm.thread("Once upon a time")
        first_word = out.split()[1]
        got = await s.gen(max_tokens=12, temperature=0, stop=first_word)
        assert first_word not in got and s.text.startswith("Once upon a time" + got + first_word)
        assert len(t.token_ids) == n
        with pytest.raises(Exception, match="temperature"):
            await t.gen(temperature=-1)
        with pytest.raises(Exception, match="bogus"):
            await t.gen(bogus=1)
        with pytest.raises(ValueError, match="fork"):
            await t.gen(n=2)
        t.close()
        s.close()
        with pytest.raises(RuntimeError, match="closed"):
            await t.gen(max_tokens=1)

    anyio.run(main)


def test_fork_of_8_computes_the_prompt_once(llm, engine):
    prompt = unique_prompt(60)

    async def main():
        t = llm.thread(prompt)
        n_prompt = len(t.token_ids)
        before = engine.stats()
        outs = await fr.gather(*(b.gen(max_tokens=2, temperature=1.0, seed=i) for i, b in enumerate(t.fork(8))))
        d = stats_delta(engine, before)
        assert len(outs) == 8
        # prompt once + at most a token or two per branch; without sharing it would be 8 * n_prompt
        assert d["prefill_tokens_computed"] <= n_prompt + 8 * 3, (d, n_prompt)
        assert d["generated_tokens"] == 16
        t.close()

    anyio.run(main)


def test_sharing_off_recomputes_forks(engine):
    llm = fr.Model(engine, share_kv=False)
    prompt = unique_prompt(60)

    async def main():
        t = llm.thread(prompt)
        n_prompt = len(t.token_ids)
        before = engine.stats()
        kids = t.fork(4)
        await fr.gather(*(b.gen(max_tokens=1, temperature=0) for b in kids))
        d = stats_delta(engine, before)
        # prefix caching (on in this engine) may still save full blocks, but each fork re-sends its prompt
        assert d["prompt_tokens"] >= 4 * n_prompt - 4
        for k in kids:
            k.close()
        t.close()

    anyio.run(main)


def test_fork_children_see_the_parent_not_each_other(llm):
    async def main():
        t = llm.thread("Once upon a time")
        await t.gen(max_tokens=3, temperature=0)
        base = t.text
        a, b = t.fork(2)
        a += " The cat"
        b += " The dog"
        ra, rb = await fr.gather(a.gen(max_tokens=4, temperature=0), b.gen(max_tokens=4, temperature=0))
        assert a.text == base + " The cat" + ra and b.text == base + " The dog" + rb
        assert "dog" not in a.text and "cat" not in b.text
        assert t.text == base  # the parent is unchanged
        t += " The end"
        assert a.text.startswith(base + " The cat")
        u = t + " Moral:"  # a fork with text appended; t unchanged
        assert u.text == base + " The end Moral:" and t.text == base + " The end"
        assert u.token_ids[: len(t.token_ids)] == t.token_ids
        await u.gen(max_tokens=2, temperature=0)
        await t.gen(max_tokens=2, temperature=0)  # the parent still works after its forks ran
        # fork of a fork that was never materialized
        c = (t + " Once")
        d = c.fork(2)[1] + " again"
        await d.gen(max_tokens=2, temperature=0)
        assert d.text.startswith(t.text + " Once again")
        for x in (t, a, b, u, c, d):
            x.close()

    anyio.run(main)


def test_forked_greedy_matches_fresh_prompt(llm, engine):
    async def main():
        t = llm.thread("Once upon a time, there was a little")
        kids = t.fork(3)
        outs = await fr.gather(*(k.gen(max_tokens=6, temperature=0) for k in kids))
        fresh = llm.thread("Once upon a time, there was a little")
        ref = await fresh.gen(max_tokens=6, temperature=0)
        assert outs == [ref] * 3
        for x in [t, fresh, *kids]:
            x.close()

    anyio.run(main)


def test_select_picks_the_likelier_option_and_appends_it(llm):
    async def main():
        t = llm.thread("Once upon a time, there was a little girl named")
        # scores are total log-probabilities: compare with an explicit computation
        scores = await t.scores([" Lily", " Xqzv"])
        assert scores[" Lily"] > scores[" Xqzv"]
        assert t.text == "Once upon a time, there was a little girl named"  # scores() leaves t as it was
        choice = await t.select([" Xqzv", " Lily", " Tom"])
        assert choice == " Lily"
        assert t.text.endswith("named Lily")
        assert t.token_ids == llm.tokenizer("Once upon a time, there was a little girl named Lily")["input_ids"]
        nxt = await t.gen(max_tokens=3, temperature=0)
        assert t.text.endswith("Lily" + nxt)
        # mean-normalized and keep-the-thread variants
        u = llm.thread("The dog said")
        c2 = await u.select([" hello", " a"], by="mean", append=False)
        assert c2 in (" hello", " a") and u.text == "The dog said"
        with pytest.raises(ValueError):
            await u.select([])
        with pytest.raises(ValueError):
            await u.select(["ok", ""])
        t.close()
        u.close()

    anyio.run(main)


def test_select_score_equals_sum_of_token_logprobs(llm, engine):
    from flowrt.engine import SamplingParams

    async def main():
        prefix = "Once upon a time, there was a"
        t = llm.thread(prefix)
        scores = await t.scores([" little girl"])
        ids = llm.tokenizer(prefix + " little girl")["input_ids"]
        n_opt = len(ids) - len(llm.tokenizer(prefix)["input_ids"])
        seq = engine.open(ids)
        out = await engine.generate(seq, SamplingParams(max_tokens=0, prompt_logprobs=0))
        ref = sum(e[tok].logprob for e, tok in zip(out.prompt_logprobs[-n_opt:], ids[-n_opt:]))
        assert scores[" little girl"] == pytest.approx(ref, abs=1e-3)
        seq.close()
        t.close()

    anyio.run(main)


def test_select_tokenizes_options_in_context(llm):
    async def main():
        # trailing space in the context: the option's word-start token must be "▁Lily", as in the full text
        t = llm.thread("Once upon a time, there was a little girl named ")
        choice = await t.select(["Lily", "Xqzv"])
        assert choice == "Lily"
        assert t.token_ids == llm.tokenizer("Once upon a time, there was a little girl named Lily")["input_ids"]
        t.close()

    anyio.run(main)


def test_stream_yields_the_same_text_as_gen(llm):
    async def main():
        t = llm.thread("Once upon a time")
        pieces = [p async for p in t.stream(max_tokens=10, temperature=0)]
        u = llm.thread("Once upon a time")
        ref = await u.gen(max_tokens=10, temperature=0)
        assert "".join(pieces) == ref and len(pieces) > 1
        assert t.text == u.text
        # leaving early aborts; the thread stays usable
        w = llm.thread("Once upon a time")
        async for _ in w.stream(max_tokens=50, temperature=0):
            break
        await anyio.sleep(0.05)
        await w.gen(max_tokens=2, temperature=0)
        for x in (t, u, w):
            x.close()

    anyio.run(main)


def test_one_call_at_a_time_per_thread(llm):
    async def main():
        t = llm.thread("Once upon a time")
        with pytest.raises(RuntimeError, match="busy"):
            await fr.gather(t.gen(max_tokens=4), t.gen(max_tokens=4))
        await anyio.sleep(0.1)
        t.close()

    anyio.run(main)


def test_cancelled_gen_aborts_and_releases(llm, engine):
    async def main():
        t = llm.thread("Once upon a time")
        with anyio.move_on_after(0.05):
            await t.gen(max_tokens=400, temperature=0, ignore_eos=True)
        t.close()
        await anyio.sleep(0.2)
        assert engine.stats()["num_running"] == 0

    anyio.run(main)


def test_closing_and_gc_release_blocks(llm, engine):
    async def main():
        t = llm.thread(unique_prompt(50))
        await t.gen(max_tokens=2, temperature=0)
        kids = t.fork(3)
        await kids[0].gen(max_tokens=2, temperature=0)
        assert engine.stats()["kv_blocks_used"] > 0
        t.close()
        t.close()  # idempotent
        del kids  # garbage collection releases too (checked by the fixture)

    anyio.run(main)


def test_model_generate_one_shot(llm):
    out = anyio.run(lambda: llm.generate("Once upon a time", max_tokens=5, temperature=0))
    assert isinstance(out, str) and out


# ------------------------------------------------------------------------------------- chat
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """A tiny random Llama whose tokenizer (stories260K's + ChatML tokens) has a chat template."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("chatml-llama")
    tok = AutoTokenizer.from_pretrained(MODEL)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHATML
    tok.save_pretrained(d)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    return str(d)


@pytest.fixture(scope="module")
def chat_engine(chat_model_dir):
    from flowrt.engine import AsyncLLM

    eng = AsyncLLM(model=chat_model_dir, dtype="float32", num_kv_blocks=256)
    yield eng
    eng.shutdown()


def test_chat_turns_are_byte_stable_and_reuse_kv(chat_engine):
    llm = fr.Model(chat_engine)

    async def main():
        c = llm.chat(system="You are terse.")
        c.user("Hi there")
        r1 = await c.assistant(max_tokens=6, temperature=0)
        out1 = c.last_output
        assert c.messages[-1] == {"role": "assistant", "content": r1}
        turn1_tokens = len(c.token_ids)
        c.user("Tell me more")
        r2 = await c.assistant(max_tokens=6, temperature=0)
        out2 = c.last_output
        c.user("And then?")
        await c.assistant(max_tokens=6, temperature=0)
        out3 = c.last_output
        assert llm.counters["chat_rerenders"] == 0 and llm.counters["chat_turns"] == 3
        # every later turn reuses the KV of all earlier turns: only the new turn's tokens are computed
        new2 = len(out2.prompt_token_ids) - turn1_tokens
        assert out2.num_cached_tokens >= turn1_tokens - 1
        assert len(out2.prompt_token_ids) - out2.num_cached_tokens <= new2 + 1
        assert out3.num_cached_tokens >= len(out2.prompt_token_ids) + len(out2.outputs[0].token_ids) - 1
        # the thread's text is exactly the template's rendering of the conversation so far
        rendered = c.render(add_generation_prompt=False)
        assert rendered.startswith(c.text) or c.text.startswith(rendered[: len(c.text)])
        assert out1.outputs[0].text == r1 and r2 == out2.outputs[0].text
        # a fork shares the conversation; branches diverge independently
        a, b = c.fork(2)
        a.user("Option A")
        b.user("Option B")
        await fr.gather(a.assistant(max_tokens=3, temperature=0), b.assistant(max_tokens=3, temperature=0))
        assert a.messages[-2]["content"] == "Option A" and b.messages[-2]["content"] == "Option B"
        assert "Option B" not in a.text and c.messages[-1]["role"] == "assistant"
        assert llm.counters["chat_rerenders"] == 0
        with pytest.raises(TypeError, match="user"):
            c += "raw text"
        for x in (c, a, b):
            x.close()

    anyio.run(main)


def test_chat_falls_back_when_the_template_rewrites_history(chat_engine):
    # A template that drops earlier assistant replies: the old rendering is not a prefix of the new one.
    forgetful = (
        "{% for message in messages %}{% if message['role'] != 'assistant' or loop.last %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    llm = fr.Model(chat_engine)

    async def main():
        c = llm.chat(chat_template=forgetful)
        c.user("Hi")
        await c.assistant(max_tokens=4, temperature=0)
        c.user("Again")
        await c.assistant(max_tokens=4, temperature=0)
        assert llm.counters["chat_rerenders"] == 1
        prompt_ids = c.last_output.prompt_token_ids
        # the second turn's prompt is exactly the fresh rendering (no stale KV)
        msgs = c.messages[:-1]
        text = llm.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                                 chat_template=forgetful)
        assert prompt_ids == llm.tokenizer(text, add_special_tokens=False)["input_ids"]
        c.close()

    anyio.run(main)


def test_chat_without_template_uses_chatml_text(llm):
    async def main():
        c = llm.chat(system="Be brief.")
        c.user("Tell me a story")
        reply = await c.assistant(max_tokens=8, temperature=0)
        assert c.text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nTell me a story")
        assert c.messages[-1]["content"] == reply
        choice = await c.select(["Once upon a time", "Zzzz qqq"])
        assert choice == "Once upon a time"
        c.close()

    anyio.run(main)


def test_step_timeout_aborts_the_llm_call_and_keeps_the_thread_consistent(llm, engine, monkeypatch):
    wf = fr.Workflow("times-out")
    seen = {}
    # every engine step takes at least 10 ms here, so 450 tokens take at least 0.9 s (at most 5 tokens a step with
    # speculative decoding) and the 0.3 s timeout always falls inside the generation, however fast the machine
    runner = engine.engine.runner
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda inp: (time.sleep(0.01), execute(inp))[1])

    @wf.step(timeout=0.3)
    async def long(llm: fr.Model) -> str:
        t = llm.thread("Once upon a time")
        seen["t"] = t
        return await t.gen(max_tokens=450, temperature=0, ignore_eos=True)

    @wf.step
    async def short(llm: fr.Model) -> str:
        with llm.thread("Once upon a time") as t:
            return await t.gen(max_tokens=3, temperature=0)

    async def main():
        r = await fr.Runtime(resources={"llm": llm}).run(wf)
        assert r.errors["long"].kind == "timeout" and r.outputs["short"]
        await anyio.sleep(0.1)
        assert engine.stats()["num_running"] == 0
        t = seen.pop("t")
        # the tokens generated before the timeout stay, and the text matches them
        assert len(t.token_ids) > 5
        assert t.text.startswith("Once upon a time")
        more = await t.gen(max_tokens=2, temperature=0)  # still usable
        assert t.text.endswith(more)
        t.close()

    anyio.run(main)


def test_text_matches_token_ids_right_after_leaving_a_stream(llm):
    async def main():
        prompt = unique_prompt(10)
        t = llm.thread(prompt)
        n_prompt = len(t.token_ids)
        seen = ""
        async for piece in t.stream(max_tokens=200, temperature=0, ignore_eos=True):
            seen += piece
            if len(seen) > 8:
                break
        # The event loop finalizes the stream (aborting its request) only later; meanwhile text and
        # token_ids both show what the loop saw.
        ids, text = t.token_ids, t.text
        assert len(ids) > n_prompt and text == prompt + seen
        assert text == prompt + t._decode_tail(ids, n_prompt)
        with pytest.raises(RuntimeError, match="still streaming.*aclosing"):
            await t.gen(max_tokens=2)
        await anyio.sleep(0.2)  # finalized: every generated token and its text are in the thread
        assert t.text == prompt + t._decode_tail(t.token_ids, n_prompt) and t.text.startswith(prompt + seen)
        await t.gen(max_tokens=2, temperature=0)
        t.close()

    anyio.run(main)


def test_cancelled_run_releases_sequences_and_blocks_at_once(engine):
    import asyncio
    import gc

    wf = fr.Workflow("cancelled")
    started = asyncio.Event()

    @wf.step
    async def talk(llm: fr.Model) -> list[str]:
        t = llm.thread(unique_prompt())
        await t.gen(max_tokens=4, temperature=0)
        a, b = t.fork(2)
        c = llm.chat(system="be brief").user("hi")
        started.set()
        return await fr.gather(a.gen(max_tokens=400, ignore_eos=True), b.gen(max_tokens=2), c.assistant(max_tokens=2),
                               anyio.sleep(60))

    async def main() -> dict:
        rt = fr.Runtime(model=engine)
        task = asyncio.create_task(rt.run(wf))
        await started.wait()
        await asyncio.sleep(0.1)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(task, 0.2)
        return engine.stats()

    gc.collect()
    gc.disable()
    try:
        st = asyncio.run(main())
    finally:
        gc.enable()
    assert st["open_sequences"] == 0 and st["kv_blocks_used"] == 0, st


def test_aclosing_a_stream_ends_it_as_the_loop_is_left(llm, engine):
    import contextlib

    async def main():
        t = llm.thread(unique_prompt(10))
        async with contextlib.aclosing(t.stream(max_tokens=200, temperature=0, ignore_eos=True)) as s:
            async for _ in s:
                break
        assert engine.stats()["num_running"] == 0  # the request ended with the loop, not after 200 tokens
        before = len(t)
        await t.gen(max_tokens=2, temperature=0, ignore_eos=True)  # usable at once, as the README says
        assert len(t) == before + 2
        t.close()
        c = llm.chat(system="Be brief.").user("Hi")
        async with contextlib.aclosing(c.stream(max_tokens=200, ignore_eos=True)) as s:
            async for _ in s:
                break
        assert engine.stats()["num_running"] == 0
        await c.assistant(max_tokens=2)
        c.close()

    start = engine.stats()["generated_tokens"]
    anyio.run(main)
    assert engine.stats()["generated_tokens"] - start < 100  # neither stream ran on to its 200 tokens
