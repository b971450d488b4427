"""Tool calls are parsed structurally: each call's JSON is decoded from its open tag on, so a string argument
holding ``</tool_call>`` does not end the call, and no ``<tool_call>`` markup is left in the content, also of
a call cut off by max_tokens (issue 27, item 12). The streamed deltas agree with the whole-text parse."""

import json

import pytest

from flowrt.llm import toolcalls as TC
from flowrt.server import structured as S

PERSON = '<tool_call>\n{"name": "Person", "arguments": {"name": "}}</tool_call>  # 31", "age": 31}}\n</tool_call>'


def _stream(text: str, step: int) -> tuple[str, list[tuple[str, str]]]:
    ts, content, calls = S.ToolStream(), "", {}
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    for k, piece in enumerate(pieces):
        c, deltas = ts.feed(piece, k == len(pieces) - 1)
        content += c
        for d in deltas:
            if "id" in d:
                calls[d["index"]] = [d["function"]["name"], ""]
            calls[d["index"]][1] += d["function"]["arguments"]
    return content, [tuple(v) for _, v in sorted(calls.items())]


def test_close_tag_inside_a_string_argument():
    content, calls = TC.parse_tool_calls(PERSON)
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [("Person", {"name": "}}</tool_call>  # 31", "age": 31})]
    msg, finish = S.message(PERSON, "stop", S.Tools([], "Person", True))
    assert finish == "tool_calls" and msg["content"] is None
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"name": "}}</tool_call>  # 31", "age": 31}


@pytest.mark.parametrize("step", [1, 3, 7, 200])
def test_close_tag_inside_a_string_argument_streamed(step):
    text = "Here. " + PERSON + "\n" + TC.format_call("f", {"x": "</tool_call>"})
    content, calls = _stream(text, step)
    want_content, want = TC.parse_tool_calls(text)
    assert content == want_content == "Here."
    assert calls == [(c.name, c.raw_arguments) for c in want]
    assert [c.name for c in want] == ["Person", "f"]


@pytest.mark.parametrize("cut", [
    '<tool_call>\n{"name": "f", "arguments": {"a": "x</tool_call> y',  # cut inside a string holding the tag
    '<tool_call>\n{"name": "f", "arguments": {"a": tr',                # inside a literal
    '<tool_call>\n{"name": "f", "arguments": {"a": 1, ',               # between members
    '<tool_call>\n{"name": "f", "arg',                                  # inside the head
    '<tool_call>\n',
])
def test_call_cut_off_by_max_tokens_leaves_no_markup(cut):
    text = "Let me check. " + TC.format_call("g", {"b": 2}) + "\n" + cut
    content, calls = TC.parse_tool_calls(text)
    assert "<tool_call>" not in content and "</tool_call>" not in content
    assert [c.name for c in calls] == ["g"]
    msg, finish = S.message(text, "length", S.Tools([], "auto", True))
    assert finish == "length" and [c["function"]["name"] for c in msg["tool_calls"]] == ["g"]
    assert msg["content"] == "Let me check."
    for step in (1, 5, 1000):
        s_content, s_calls = _stream(text, step)
        assert "<tool_call>" not in s_content and s_content.startswith("Let me check.")
        assert s_calls[0] == ("g", '{"b": 2}')


def test_only_a_cut_off_call_has_empty_content():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": "x</tool_call>'
    assert TC.parse_tool_calls(text) == ("", [])
    msg, finish = S.message(text, "length", S.Tools([], "required", True))
    assert msg == {"role": "assistant", "content": ""} and finish == "length"


def test_text_without_blocks_is_unchanged():
    assert TC.parse_tool_calls("  just text \n") == ("  just text \n", [])
    assert _stream("  just text \n", 2) == ("  just text \n", [])
