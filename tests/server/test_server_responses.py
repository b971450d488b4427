"""/v1/responses on the tiny random chat model (tests/server/test_server_langchain.py's): request parsing and
refusals, the event order, the store's bounds and previous_response_id continuing the token sequence. The
model's text is noise; the tests check the protocol, the constraints' guarantees and the token counts. Each
response object and event is validated against the openai package's own pydantic types."""

import json
from array import array
from typing import get_args

import httpx
import pytest
from support import make_chat_model, serve_model
from test_server_langchain import TEMPLATE

from flowrt.server import responses_items as I
from flowrt.server.errors import OpenAIError
from flowrt.server.responses_events import EventStream
from flowrt.server.responses_store import ResponseStore, StoredResponse

openai = pytest.importorskip("openai")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402

# event type -> the openai package's pydantic class for it (its union has no pydantic discriminator)
EVENTS = {cls.model_fields["type"].annotation.__args__[0]: cls for cls in get_args(get_args(ResponseStreamEvent)[0])}

MODEL = "tiny-responses"
KEY = "sk-test"
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                         "required": ["city"]}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_chat_model(tmp_path_factory.mktemp("resp"), TEMPLATE, max_position_embeddings=1024)
    yield from serve_model(model, served_model_name=MODEL, api_key=KEY, responses_max=3)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server, body, key=KEY):
    return httpx.post(server.url + "/v1/responses", json={"model": MODEL, **body}, timeout=120,
                      headers={"Authorization": f"Bearer {key}"})


# ---- without a model -----------------------------------------------------------------------------------


def _entry(rid: str, text: str = "x") -> StoredResponse:
    return StoredResponse({"id": rid}, [{"role": "user", "content": text}], array("i", [1, 2, 3]), text)


def test_store_evicts_the_oldest_by_count_and_by_bytes():
    s = ResponseStore(max_responses=2, max_bytes=10_000)
    for rid in ("a", "b", "c"):
        assert s.put(_entry(rid))
    assert s.get("a") is None and s.get("b") and s.get("c") and s.evicted == 1
    one = _entry("d").nbytes
    s = ResponseStore(max_responses=100, max_bytes=2 * one + 1)
    for rid in ("d", "e", "f"):
        s.put(_entry(rid))
    assert [r for r in "def" if s.get(r)] == ["e", "f"] and s.bytes == 2 * one
    assert not s.put(_entry("big", "y" * 3 * one)) and s.get("big") is None  # alone over the bound: not kept
    assert s.delete("e") and not s.delete("e") and s.bytes == one


def test_input_items_become_chat_messages():
    msgs = I.input_messages([
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ])
    assert msgs[0] == {"role": "user", "content": "Weather ?"}
    assert msgs[1]["content"] == "Let me see." and [c["id"] for c in msgs[1]["tool_calls"]] == ["c1", "c2"]
    assert msgs[2] == {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"}


@pytest.mark.parametrize("items, param", [
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input[0].content[0]"),
    ([{"type": "reasoning", "summary": []}], "input[0].type"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
    ([{"role": "tool", "content": "x"}], "input[0].role"),
])
def test_input_items_it_cannot_take_are_a_400_naming_them(items, param):
    with pytest.raises(OpenAIError) as e:
        I.input_messages(items)
    assert e.value.status == 400 and e.value.param == param


def test_event_stream_closes_each_item_before_the_next():
    es = EventStream()
    call = [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}},
            {"index": 0, "function": {"arguments": '{"a": 1}'}}]
    raw = es.text("Hi") + es.text(" there") + es.calls(call) + es.text("Done.") + es.close()
    events = [json.loads(r.split("data: ", 1)[1]) for r in raw]
    for r, e in zip(raw, events):
        assert r.startswith(f"event: {e['type']}\n")
        EVENTS[e["type"]].model_validate(e)
    assert [e["type"].removeprefix("response.") for e in events] == [
        "output_item.added", "content_part.added", "output_text.delta", "output_text.delta", "output_text.done",
        "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.done", "content_part.done",
        "output_item.done"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [it["type"] for it in es.items] == ["message", "function_call", "message"]
    assert es.items[0]["content"][0]["text"] == "Hi there" and es.items[1]["arguments"] == '{"a": 1}'
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]


# ---- over HTTP ------------------------------------------------------------------------------------------


def test_plain_response_and_get_delete(client):
    r = client.responses.create(model=MODEL, input="Tell me a story.", instructions="Be brief.", max_output_tokens=8,
                                extra_body={"seed": 1}, metadata={"k": "v"})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 8 and r.usage.input_tokens > 0 and r.metadata == {"k": "v"}
    assert r.output[0].type == "message" and r.output_text == r.output[0].content[0].text
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_event_order_and_sequence_numbers(server):
    with httpx.stream("POST", server.url + "/v1/responses", timeout=120, headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "input": "Weather?", "tools": TOOLS, "tool_choice": "required",
                            "parallel_tool_calls": False, "stream": True}) as resp:
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    events = [EVENTS[d["type"]].model_validate(d) for d in (json.loads(ln[6:]) for ln in lines)]
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (call,) = done.output
    assert call.arguments == args == events[-3].arguments and json.loads(args)["city"] in ("Paris", "Rome")


def test_streamed_text_matches_the_final_object(client):
    events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=12, extra_body={"seed": 2},
                                          stream=True))
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and final.incomplete_details.reason == "max_output_tokens"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == final.output_text and final.usage.output_tokens == 12


def test_function_call_round_trip_continues_the_token_sequence(client, server):
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, extra_body={"seed": 3})
    (call,) = first.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    n = first.usage.input_tokens + first.usage.output_tokens
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    follow = client.responses.create(model=MODEL, previous_response_id=first.id, tools=TOOLS, max_output_tokens=4,
                                     input=[result])
    assert follow.previous_response_id == first.id
    store = server.app.state.flowrt_responses
    before, after = store.get(first.id).token_ids, store.get(follow.id).token_ids
    assert len(before) == n and after[:n] == before  # the same token sequence, continued
    bs = server.engine.stats()["block_size"]
    # the first prompt's full blocks and the computed ones of its output come from the prefix cache (the last
    # tokens of a constrained call are forced, so not all of them were computed)
    assert follow.usage.input_tokens_details.cached_tokens > first.usage.input_tokens // bs * bs


def test_json_schema_format(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    r = client.responses.create(model=MODEL, input="A number?", text={"format": {"type": "json_schema", "name": "num",
                                                                                 "schema": schema, "strict": True}})
    assert 0 <= json.loads(r.output_text)["n"] <= 9 and r.text.format.type == "json_schema"


def test_store_false_keeps_nothing_and_the_store_is_bounded(client):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    ids = [client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).id for _ in range(4)]
    with pytest.raises(openai.NotFoundError):  # responses_max=3: the oldest went
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[-1]).id == ids[-1]


def test_unknown_previous_response_is_a_404(server):
    r = post(server, {"input": "Hi", "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize("body, param", [
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 5000}, "input"),
])
def test_unsupported_or_bad_fields_are_a_400_naming_them(server, body, param):
    r = post(server, {"input": "Hi", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_hints_are_ignored(server):
    r = post(server, {"input": "Hi", "max_output_tokens": 2, "service_tier": "auto", "prompt_cache_key": "k",
                      "safety_identifier": "u", "reasoning": {"effort": None},
                      "include": ["reasoning.encrypted_content"], "text": {"verbosity": "low"}})
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())


def test_the_api_key_guards_every_route(server):
    assert post(server, {"input": "Hi"}, key="wrong").status_code == 401
    assert httpx.get(server.url + "/v1/responses/resp_x").status_code == 401
    assert httpx.delete(server.url + "/v1/responses/resp_x").status_code == 401
