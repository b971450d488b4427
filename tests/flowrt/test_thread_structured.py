"""Constrained generation on threads (flowrt/llm/structured.py): gen/stream/assistant with json= (pydantic model,
type, dict schema), regex=, choice=, grammar=; forks; cut-off and bad-constraint errors. On stories260K (a
tiny story model that never writes JSON by itself: only the constraint makes its output valid)."""

from __future__ import annotations

import json
from typing import Annotated, Literal

import anyio
import pytest
from pydantic import BaseModel, Field

import flowrt as fr
from support import STORIES, leak_checked_model

pytest.importorskip("flowrt.engine")

MODEL = str(STORIES)


class Answer(BaseModel):
    name: Annotated[str, Field(max_length=8)]
    age: Annotated[int, Field(ge=0, le=99)]
    mood: Literal["happy", "sad"]


class Record(BaseModel):
    word: Annotated[str, Field(min_length=1, max_length=6)]
    n: Annotated[int, Field(ge=0, le=9)]


@pytest.fixture()
def llm(engine):
    yield from leak_checked_model(engine)


def run(fn, *args):
    return anyio.run(fn, *args)


def test_gen_json_model_returns_a_validated_instance(llm):
    async def main():
        with llm.thread("Once upon a time") as t:
            free = await t.fork(1)[0].gen(max_tokens=40, temperature=0)
            got = await t.gen(json=Answer, temperature=0)
            return free, got, t.last_output.outputs[0].text, t.text

    free, got, out_text, text = run(main)
    with pytest.raises(ValueError):
        json.loads(free)  # the model alone writes a story, not JSON
    assert isinstance(got, Answer)
    assert got.mood in ("happy", "sad") and 0 <= got.age <= 99
    assert Answer.model_validate_json(out_text) == got and text.endswith(out_text)  # the thread keeps the JSON


def test_gen_json_dict_schema_type_and_list(llm):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "k": {"enum": ["a", "b"]}},
              "required": ["ok", "k"], "additionalProperties": False}

    async def main():
        a = await llm.thread("Tim said").gen(json=schema, temperature=0)
        b = await llm.thread("Lily had").gen(json=list[Record], temperature=0.8, seed=3)
        c = await llm.thread("One day").gen(json=Annotated[int, Field(ge=0, le=999)], max_tokens=8, temperature=0)
        d = await llm.thread("The end").gen(json=json.dumps({"type": "boolean"}), temperature=0)
        return a, b, c, d

    a, b, c, d = run(main)
    assert isinstance(a, dict) and set(a) == {"ok", "k"} and isinstance(a["ok"], bool)
    assert isinstance(b, list) and all(isinstance(r, Record) for r in b)
    assert isinstance(c, int)
    assert isinstance(d, bool)


def test_regex_choice_grammar_return_text(llm):
    grammar = 'start: "The " ANIMAL " is " ("big" | "small") "."\nANIMAL: "cat" | "dog"'

    async def main():
        r = await llm.thread("Once upon a time").gen(regex=r"[a-z]{3}-[0-9]{2}", temperature=0)
        c = await llm.thread("Once upon a time").gen(choice=["yes", "no", "maybe"], temperature=0.9, seed=1)
        g = await llm.thread("Once upon a time").gen(grammar=grammar, temperature=0.9, seed=2)
        return r, c, g

    r, c, g = run(main)
    import re

    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", r)
    assert c in ("yes", "no", "maybe")
    assert re.fullmatch(r"The (cat|dog) is (big|small)\.", g)


def test_stream_with_json_yields_the_constrained_text(llm):
    async def main():
        with llm.thread("Once upon a time") as t:
            pieces = [p async for p in t.stream(json=Answer, temperature=0)]
            return pieces, t.last_output.outputs[0].text

    pieces, text = run(main)
    assert len(pieces) > 1 and "".join(pieces) == text
    Answer.model_validate_json(text)

    async def left_early():
        from contextlib import aclosing

        with llm.thread("Once upon a time") as t:
            async with aclosing(t.stream(json=Answer)) as s:
                first = await s.__anext__()
            return first, await t.gen(choice=["x", "y"])  # the thread is usable again

    first, after = run(left_early)
    assert first.startswith("{") and after in ("x", "y")


def test_forked_constrained_thread_every_branch_valid(llm):
    async def main():
        with llm.thread("Once upon a time, there was") as t:
            branches = t.fork(4)
            outs = await fr.gather(*(b.gen(json=Record, temperature=1.0, seed=i) for i, b in enumerate(branches)))
            plain = await t.gen(max_tokens=4, temperature=0)  # the parent is not constrained
            for b in branches:
                b.close()
            return outs, plain

    outs, plain = run(main)
    assert len(outs) == 4 and all(isinstance(o, Record) for o in outs)
    assert isinstance(plain, str)


def test_chat_assistant_json_records_the_text(llm):
    async def main():
        with llm.chat(system="Be brief.") as c:
            c.user("Who is it?")
            got = await c.assistant(json=Answer, temperature=0)
            return got, c.messages[-1]

    got, msg = run(main)
    assert isinstance(got, Answer)
    assert msg["role"] == "assistant" and Answer.model_validate_json(msg["content"]) == got


def test_cut_off_output_raises_naming_max_tokens(llm):
    async def main():
        with llm.thread("Once upon a time") as t:
            await t.gen(json=Answer, max_tokens=3, temperature=0)

    with pytest.raises(fr.IncompleteOutputError, match="max_tokens=3") as e:
        run(main)
    assert e.value.text  # the partial output is kept on the error

    async def streamed():
        with llm.thread("Once upon a time") as t:
            async for _ in t.stream(json=Answer, max_tokens=3):
                pass

    with pytest.raises(fr.IncompleteOutputError, match="max_tokens=3"):
        run(streamed)


def test_bad_constraints_raise_value_error_naming_the_keyword(llm):
    async def bad(**kw):
        with llm.thread("Once upon a time") as t:
            await t.gen(**kw)

    with pytest.raises(ValueError, match=r"json="):
        run(lambda: bad(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}))
    with pytest.raises(ValueError, match=r"json="):
        run(lambda: bad(json=object()))
    with pytest.raises(ValueError, match=r"json="):
        run(lambda: bad(json="{not json"))
    with pytest.raises(ValueError, match=r"regex="):
        run(lambda: bad(regex="(unclosed"))
    with pytest.raises(ValueError, match=r"grammar="):
        run(lambda: bad(grammar="start: nothing_defined"))
    with pytest.raises(ValueError, match=r"choice="):
        run(lambda: bad(choice=[]))
    with pytest.raises(ValueError, match="one of json=, regex="):
        run(lambda: bad(json=Answer, regex="a"))

    async def still_works():  # the thread and engine are fine after a refused constraint
        with llm.thread("Once upon a time") as t:
            return await t.gen(choice=["a", "b"])

    assert run(still_works) in ("a", "b")


def test_gen_json_under_a_token_sink_streams_and_still_validates(llm):
    from flowrt.context import current_sink
    from flowrt.events import EventSink, Token

    events = []

    async def main():
        tok = current_sink.set(EventSink(events.append, tokens=True))
        try:
            with llm.thread("Once upon a time") as t:
                return await t.gen(json=Record, temperature=0)
        finally:
            current_sink.reset(tok)

    got = run(main)
    assert isinstance(got, Record)
    tokens = [e for e in events if isinstance(e, Token)]
    assert tokens and "".join(e.text for e in tokens) == got.model_dump_json().replace('":', '": ').replace(',"', ', "')
