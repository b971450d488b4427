"""Threads refuse text that is not valid Unicode (a lone surrogate) where it is appended, with a ValueError
naming the problem, not a TypeError from the tokenizer at the next model call (issue 27, item 3)."""

import pytest

import flowrt as fr


@pytest.fixture(scope="module")
def model(engine):
    return fr.Model(engine)


def test_append_refuses_a_lone_surrogate(model):
    t = model.thread("Once upon a time")
    with pytest.raises(ValueError, match="text appended to the thread contains a lone surrogate"):
        t += " \ud800"
    t += " \U0001F600"  # a whole pair is fine


def test_chat_messages_refuse_a_lone_surrogate(model):
    c = model.chat()
    with pytest.raises(ValueError, match="user message content contains a lone surrogate"):
        c.user("hi \ud800")
    with pytest.raises(ValueError, match="system message content contains a lone surrogate"):
        c.system("\udfff")
