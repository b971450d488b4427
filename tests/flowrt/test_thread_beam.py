"""t.beam(): beam search from a thread, the beams returned as threads forked from it."""

import asyncio
import json

import pytest

from support import leak_checked_model
from flowrt.engine import BeamSearchParams


@pytest.fixture()
def llm(engine):
    yield from leak_checked_model(engine)


def test_beams_are_forks_with_scores(llm, engine):
    async def main():
        t = llm.thread("Once upon a time")
        beams = await t.beam(width=3, max_tokens=8, ignore_eos=True)
        params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
        ref = await engine.beam_search("Once upon a time", params)
        assert [b.token_ids for b in beams] == [s.tokens for s in ref.sequences]
        assert [b.score for b in beams] == pytest.approx([s.score for s in ref.sequences], abs=1e-5)
        assert [b.text for b in beams] == ["Once upon a time" + s.output_text for s in ref.sequences]
        assert t.text == "Once upon a time" and len(t.token_ids) == len(beams[0].token_ids) - 8
        # a beam is a thread like any other: it continues, and the parent still works
        more = await beams[0].gen(max_tokens=4, temperature=0, ignore_eos=True)
        assert beams[0].text.endswith(more)
        await t.gen(max_tokens=2, temperature=0)
        for b in beams:
            b.close()
        t.close()

    asyncio.run(main())


def test_json_beams_each_follow_the_schema(llm):
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 8},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120}}}

    async def main():
        t = llm.thread("Lily is a girl. JSON:")
        beams = await t.beam(width=4, max_tokens=40, json=schema)
        assert len(beams) == 4
        for b in beams:
            value = json.loads(b.text[len(t.text):])
            assert set(value) == {"name", "age"}
            b.close()
        t.close()

    asyncio.run(main())


def test_bad_keywords(llm):
    async def main():
        t = llm.thread("Hi")
        with pytest.raises(TypeError, match="temperature"):
            await t.beam(temperature=0.5)
        with pytest.raises(ValueError, match="beam_width"):
            await t.beam(width=50)
        t.close()

    asyncio.run(main())


@pytest.mark.parametrize("earlier_turn", [False, True], ids=["first-turn", "later-turn"])
def test_chat_beams_are_assistant_replies(llm, engine, earlier_turn):
    """A chat thread's beam search answers as the assistant: the conversation is rendered with the generation
    prompt first, and each beam is a chat thread whose last message is its reply, ready for the next turn."""

    async def main():
        c = llm.chat(system="Be brief.")
        if earlier_turn:
            await c.user("Hi").assistant(max_tokens=3, temperature=0)
        c.user("Tell me a story")
        prompt = c.render(add_generation_prompt=True)
        messages = list(c.messages)
        beams = await c.beam(width=3, max_tokens=6, ignore_eos=True)
        n = len(beams[0].token_ids) - 6
        assert llm.tokenizer.decode(beams[0].token_ids[:n]) == llm.tokenizer.decode(
            llm.encode(prompt, first=True, special_prefix=False))
        ref = await engine.beam_search({"prompt_token_ids": beams[0].token_ids[:n]},
                                       BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
        assert [b.token_ids for b in beams] == [s.tokens for s in ref.sequences]
        for b, s in zip(beams, ref.sequences):
            assert type(b) is type(c)
            assert b.messages == messages + [{"role": "assistant", "content": s.output_text}]
            assert b.text == prompt + s.output_text
        assert c.messages == messages  # the thread itself is unchanged
        # a beam continues the conversation without re-rendering it, and so does the thread
        rerenders = llm.counters["chat_rerenders"]
        beams[0].user("And then?")
        reply = await beams[0].assistant(max_tokens=4, temperature=0)
        assert beams[0].messages[-1] == {"role": "assistant", "content": reply}
        assert beams[0].messages[-3]["content"] == ref.sequences[0].output_text
        c.user("Another one")
        await c.assistant(max_tokens=3, temperature=0)
        assert c.messages[-3:-1] == [messages[-1], {"role": "user", "content": "Another one"}]
        assert llm.counters["chat_rerenders"] == rerenders
        for x in (*beams, c):
            x.close()

    asyncio.run(main())


def test_chat_json_beams_record_the_json_reply(llm):
    schema = {"type": "object", "additionalProperties": False, "required": ["name"],
              "properties": {"name": {"type": "string", "maxLength": 8}}}

    async def main():
        c = llm.chat().user("Name a girl as JSON.")
        beams = await c.beam(width=2, max_tokens=30, json=schema)
        assert len(beams) == 2
        for b in beams:
            assert b.messages[-1]["role"] == "assistant" and set(json.loads(b.messages[-1]["content"])) == {"name"}
            assert b.text.endswith(b.messages[-1]["content"])
            b.close()
        c.close()

    asyncio.run(main())
