"""Structured outputs and tool calls over HTTP (response_format, vLLM's structured_outputs / guided_*,
tools / tool_choice / parallel_tool_calls), through the real openai client.

The chat model is tiny and random (stories260K's tokenizer, a ChatML template that renders `tools` and
`tool_calls` the way Qwen2.5's does): its text is noise, so the tests check what the constraint guarantees
(valid JSON for the schema, valid calls) and the protocol (tool-call shapes, streamed deltas, errors).
"""

import json
import threading
import time
from typing import Literal

import httpx
import openai
import pytest
from support import STORIES, make_chat_model, serve_model
from pydantic import BaseModel, Field

MODEL = "tiny-tools"
# ChatML with Hermes-style tools, like Qwen2.5's template (tools in the system turn, calls as blocks)
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'system' and tools %}"
    "{% elif m['role'] == 'assistant' and m.get('tool_calls') %}<|im_start|>assistant\n{{ m['content'] or '' }}"
    "{% for c in m['tool_calls'] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time.",
    "parameters": {"type": "object", "properties": {"tz": {"type": "integer", "minimum": -12, "maximum": 12}},
                   "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Weather in Paris?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("tiny-tools"), TOOLS_TEMPLATE, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def server(model_dir):
    yield from serve_model(model_dir, served_model_name=MODEL)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _valid(obj, schema) -> None:
    import jsonschema

    jsonschema.validate(obj, schema)


def _args_schema(tool):
    return tool["function"]["parameters"]


def test_response_format_json_schema(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=80, temperature=1.0, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    (c,) = r.choices
    assert c.finish_reason == "stop"
    _valid(json.loads(c.message.content), PERSON)


def test_parse_with_pydantic_model(client):
    class Answer(BaseModel):
        ok: bool
        color: Literal["red", "green", "blue"]
        score: int = Field(ge=0, le=10)

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    r = parse(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0, response_format=Answer)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Answer) and 0 <= parsed.score <= 10


def test_json_object_and_structured_outputs_on_completions(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=60, temperature=0,
                                  extra_body={"structured_outputs": {"json": PERSON}})
    _valid(json.loads(r.choices[0].text), PERSON)
    r = client.completions.create(model=MODEL, prompt="Once", max_tokens=60, temperature=0,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "p", "schema": PERSON}}})
    _valid(json.loads(r.choices[0].text), PERSON)


def test_guided_fields(client):
    r = client.completions.create(model=MODEL, prompt="Once", max_tokens=20, temperature=1.0, seed=2,
                                  extra_body={"guided_regex": "[a-c]{3}-[0-9]{2}"})
    import re
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", r.choices[0].text)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=3,
                                       extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert r.choices[0].message.content in ("yes", "no", "maybe")
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                       extra_body={"guided_json": PERSON})
    _valid(json.loads(r.choices[0].message.content), PERSON)
    r = client.completions.create(model=MODEL, prompt="Once", max_tokens=20, temperature=0,
                                  extra_body={"guided_grammar": 'start: "a" ("b" | "c")+ "."'})
    assert re.fullmatch(r"a[bc]+\.", r.choices[0].text) or r.choices[0].finish_reason == "length"


def test_tool_choice_required(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=5)
    (c,) = r.choices
    assert c.finish_reason == "tool_calls"
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    _valid(json.loads(call.function.arguments), _args_schema(tool))


def test_named_tool_choice_and_parallel(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=1.0, seed=7,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    (c,) = r.choices
    assert c.message.tool_calls, c.message.content
    for call in c.message.tool_calls:  # parallel calls allowed: one or more, all of the named tool
        assert call.function.name == "get_time"
        _valid(json.loads(call.function.arguments), _args_schema(TIME))
    assert c.finish_reason in ("tool_calls", "length")
    assert len({call.id for call in c.message.tool_calls}) == len(c.message.tool_calls)


def test_streamed_tool_calls_reassemble(client):
    kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=80, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    content = ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                if d.id is not None:  # the first delta of a call: id, type and name, before any arguments
                    assert d.index not in calls and d.type == "function" and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" == whole.finish_reason
    assert content == (whole.message.content or "")
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_auto_and_none(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=30, temperature=0)
    c = r.choices[0]  # auto: free text, or valid calls
    for call in c.message.tool_calls or []:
        json.loads(call.function.arguments)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                       max_tokens=10, temperature=0)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")


def test_tool_result_follow_up(server, client):
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=80, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    follow = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    r = client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the template rendered the call and the result
    text = server.engine.tokenizer.apply_chat_template(
        [{"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}], tokenize=False)
    assert "<tool_response>" in text
    assert r.usage.prompt_tokens > first.usage.prompt_tokens


def test_bad_constraints_are_400_naming_the_parameter(client):
    cases = [
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
         "response_format.json_schema.schema"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
         "response_format.json_schema.schema"),
        (dict(response_format={"type": "yaml"}), "response_format.type"),
        (dict(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pad": "x" * 70_000}}}), "response_format.json_schema.schema"),
        (dict(extra_body={"guided_regex": "[a-"}), "guided_regex"),
        (dict(extra_body={"guided_grammar": "start: undefined_rule"}), "guided_grammar"),
        (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs"),
        (dict(extra_body={"guided_regex": "a", "guided_choice": ["b"]}), "guided_choice"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0]"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
              tool_choice="required"), "tools"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, **kw)
        assert e.value.status_code == 400
        assert e.value.body["param"] == param, (kw, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body={"guided_regex": "(("})
    assert e.value.body["param"] == "guided_regex"


def test_compile_runs_off_the_event_loop_under_a_time_cap(server, monkeypatch):
    from flowrt.engine.decoding import structured_output

    real = structured_output._new_matcher

    def slow(tok, grammar):
        time.sleep(1.5)
        return real(tok, grammar)

    monkeypatch.setattr(structured_output, "_new_matcher", slow)
    result = {}

    def post():
        result["r"] = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "x", "max_tokens": 4, "guided_regex": "[0-9]{1,3}x[a-f]{2,7}"})

    t = threading.Thread(target=post)
    t.start()
    time.sleep(0.3)
    t0 = time.perf_counter()
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    assert time.perf_counter() - t0 < 1.0  # the event loop was free while the grammar compiled
    t.join()
    assert result["r"].status_code == 200, result["r"].text
    monkeypatch.setattr(server.engine.engine.structured, "compile_timeout_s", 0.05)
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "x", "max_tokens": 4, "guided_regex": "[0-9]{1,4}y[a-f]{2,7}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"
    assert "longer than" in r.json()["error"]["message"]


# ---- flowrt.llm.toolcalls and the stream splitter, without a server ---------------------------------------


def _accepts(so, text: str) -> bool:
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    tok = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(STORIES))
    m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(so.grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(tok.tokenize_str(text)) and m.is_accepting()


def test_toolcalls_constraints_and_parse():
    from flowrt.llm import toolcalls as TC

    specs = [TC.ToolSpec.from_openai(t) for t in TOOLS]
    assert specs[0].to_openai() == WEATHER and TC.render_tools_for_template(TOOLS) == TOOLS
    a = TC.format_call("get_weather", {"city": "Paris", "unit": "c"})
    b = TC.format_call("get_time", {"tz": 3})
    bad = TC.format_call("get_weather", {"city": "Paris"})  # misses "unit"
    req = TC.call_constraint(specs, "required")
    assert _accepts(req, a) and _accepts(req, a + "\n" + b)
    assert not _accepts(req, bad) and not _accepts(req, "Sure. " + a)
    assert not _accepts(TC.call_constraint(specs, "required", parallel=False), a + "\n" + b)
    named = TC.call_constraint(specs, "get_time")
    assert _accepts(named, b) and not _accepts(named, a)
    with pytest.raises(ValueError):
        TC.call_constraint(specs, "nope")
    auto = TC.auto_constraint(specs)
    assert _accepts(auto, "just text") and _accepts(auto, "Let me see. " + a + " done")
    assert not _accepts(auto, "Let me see. " + bad)

    content, calls = TC.parse_tool_calls("Sure.\n" + a + "\n" + b)
    assert content == "Sure." and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": 3})]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    assert json.loads(calls[0].to_openai()["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    broken = "x <tool_call>\n{not json}\n</tool_call> y"
    assert TC.parse_tool_calls(broken) == ("x  y", [])  # no markup stays in the content
    assert TC.parse_tool_calls('<tool_call> {"name": "f", "arguments": "{\\"a\\": 1}"} ')[1][0].arguments == {"a": 1}
    assert TC.parse_tool_calls("") == ("", [])


@pytest.mark.parametrize("step", [1, 2, 5, 13])
def test_tool_stream_splitter_matches_parse(step):
    from flowrt.llm import toolcalls as TC
    from flowrt.server.structured import ToolStream

    text = ("Checking. " + TC.format_call("get_weather", {"city": "Pa}ris", "unit": "c"}) + "\n" +
            TC.format_call("get_time", {"tz": -3}) + "\n")
    ts, content, calls = ToolStream(), "", {}
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for k, piece in enumerate(pieces):
        c, deltas = ts.feed(piece, k == len(pieces) - 1)
        content += c
        for d in deltas:
            if "id" in d:
                assert d["index"] not in calls and d["function"]["arguments"] == ""
                calls[d["index"]] = [d["function"]["name"], ""]
            calls[d["index"]][1] += d["function"]["arguments"]
    want_content, want = TC.parse_tool_calls(text)
    assert content == want_content == "Checking."
    assert [tuple(v) for _, v in sorted(calls.items())] == [(c.name, c.raw_arguments) for c in want]


# ---- issue 27, items 8 and 9: bounded output ------------------------------------------------------------
OPEN_TOOL = {"type": "function", "function": {   # no additionalProperties, an unbounded number and integer
    "name": "locate", "parameters": {"type": "object", "properties": {
        "lat": {"type": "number"}, "zoom": {"type": "integer"}, "tag": {"enum": ["a", "b"]}},
        "required": ["lat", "zoom", "tag"]}}}


def _call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def test_tool_arguments_are_closed_and_bounded():
    from flowrt.llm import toolcalls as TC

    so = TC.call_constraint([OPEN_TOOL], "locate")
    assert _accepts(so, _call("locate", '{"lat": -12.5, "zoom": 1234567890123456789, "tag": "a"}'))
    assert not _accepts(so, _call("locate", '{"lat": 1, "zoom": 3, "tag": "a", "extra": 1}'))   # named only
    assert not _accepts(so, _call("locate", '{"lat": 1.' + "5" * 20 + ', "zoom": 3, "tag": "a"}'))
    assert not _accepts(so, _call("locate", '{"lat": 1, "zoom": ' + "9" * 25 + ', "tag": "a"}'))
    loose = {"type": "function", "function": {**OPEN_TOOL["function"], "strict": False}}
    assert _accepts(TC.call_constraint([loose], "locate"), _call("locate", '{"lat": 1, "zoom": 3, "tag": "a", "x": 1}'))
    assert TC.ToolSpec.from_openai(loose).to_openai()["function"]["strict"] is False


def test_tool_calls_per_response_are_bounded():
    from flowrt.llm import toolcalls as TC

    one = _call("get_time", '{"tz": 1}')
    assert _accepts(TC.call_constraint(TOOLS), "\n".join([one] * TC.MAX_CALLS))
    assert not _accepts(TC.call_constraint(TOOLS), "\n".join([one] * (TC.MAX_CALLS + 1)))
    assert _accepts(TC.call_constraint(TOOLS, max_calls=2), one + "\n" + one)
    assert not _accepts(TC.call_constraint(TOOLS, max_calls=2), "\n".join([one] * 3))
    assert not _accepts(TC.call_constraint(TOOLS, parallel=False), one + "\n" + one)
    with pytest.raises(ValueError, match="max_tool_calls must be a positive integer"):
        TC.call_constraint(TOOLS, max_calls=0)


def test_required_tool_calls_with_n3_and_no_max_tokens_finish(client):
    """n=3 and no max_tokens: every choice ends with its calls (at most MAX_CALLS: the grammar ends there,
    test_tool_calls_per_response_are_bounded), and max_tool_calls lowers the bound."""
    from flowrt.llm import toolcalls as TC

    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       n=3, temperature=1.0, seed=11)
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c
        assert 1 <= len(c.message.tool_calls) <= TC.MAX_CALLS
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       n=2, temperature=1.0, seed=12, extra_body={"max_tool_calls": 2})
    assert all(c.finish_reason == "tool_calls" and len(c.message.tool_calls) <= 2 for c in r.choices)


def test_response_format_strict_and_bound_numbers_reach_the_constraint():
    from types import SimpleNamespace

    from flowrt.server import structured as S

    def constraint(rf, **fields):
        req = SimpleNamespace(response_format=rf, structured_outputs=None, guided_json=None, guided_regex=None,
                              guided_choice=None, guided_grammar=None, bound_numbers=None)
        for k, v in fields.items():
            setattr(req, k, v)
        return S.from_request(req).params

    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    p = constraint(rf)
    assert p.strict is True and p.bound_numbers is True
    assert constraint({**rf, "json_schema": {**rf["json_schema"], "strict": False}}).strict is False
    assert constraint(rf, bound_numbers=False).bound_numbers is False
    assert constraint(None, structured_outputs={"json": PERSON, "bound_numbers": False}).bound_numbers is False
    with pytest.raises(Exception, match="strict must be true or false"):
        constraint({**rf, "json_schema": {**rf["json_schema"], "strict": "yes"}})


def test_response_format_generates_only_the_named_keys(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "age": {"type": "integer"}}, "required": ["name"]}
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=4, max_tokens=60, temperature=1.0, seed=4,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    for c in r.choices:
        if c.finish_reason == "stop":
            obj = json.loads(c.message.content)
            assert set(obj) <= {"name", "age"} and "name" in obj
            assert abs(obj.get("age", 0)) < 2**63
