"""LangChain's ChatOpenAI (langchain-openai, an optional test dependency) as a client of the server, beside
the openai client: invoke, bind_tools with a tool result follow-up, and with_structured_output by function
calling and by json_schema (issue 27, item 12). The model is tiny and random (stories260K's tokenizer, a
ChatML template with Hermes-style tools), so the tests check what the constraints guarantee and the
protocol LangChain relies on, not the text."""

from typing import Literal

import pytest
from pydantic import BaseModel, Field
from support import make_chat_model, serve_model

pytest.importorskip("langchain_openai")
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402

MODEL = "tiny-tools"
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' and m.get('tool_calls') %}<|im_start|>assistant\n"
    "{{ m['content'] or '' }}{% for c in m['tool_calls'] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Person(BaseModel):
    """A person."""
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)


class Tagged(BaseModel):
    """A value whose only possible string holds the closing tag of a tool call."""
    note: Literal["}}</tool_call>  # 31"]
    n: int = Field(ge=0, le=9)


def get_weather(city: Literal["Paris", "Rome"]) -> str:
    """The weather in a city."""
    return "sunny"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_chat_model(tmp_path_factory.mktemp("lc"), TEMPLATE, max_position_embeddings=1024)
    yield from serve_model(model, served_model_name=MODEL)


@pytest.fixture(scope="module")
def llm(server):
    return ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL, temperature=1.0, seed=3,
                      max_tokens=120, max_retries=0, timeout=120)


def test_invoke(llm):
    msg = llm.invoke("Tell me a story.")
    assert isinstance(msg, AIMessage) and isinstance(msg.content, str)
    assert msg.response_metadata["finish_reason"] in ("stop", "length")
    assert msg.usage_metadata["output_tokens"] >= 1


def test_bind_tools_and_a_tool_result_follow_up(llm):
    # one call: the random model's sampled path decides whether it adds more, and may run out of tokens doing so
    bound = llm.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False)
    question = HumanMessage("Weather in Paris?")
    ai = bound.invoke([question])
    assert ai.response_metadata["finish_reason"] == "tool_calls" and "<tool_call>" not in ai.content
    (call,) = ai.tool_calls[:1]
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Rome")
    answer = llm.bind_tools([get_weather]).invoke(
        [question, ai, ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])])
    assert isinstance(answer, AIMessage) and "<tool_call>" not in answer.content


def test_structured_output_by_function_calling(llm):
    person = llm.with_structured_output(Person, method="function_calling").invoke("A person?")
    assert isinstance(person, Person)


def test_structured_output_whose_string_holds_the_close_tag(llm):
    """The issue's failure: a constrained string holding ``</tool_call>`` ended the call early, the
    parser found none and LangChain returned None."""
    tagged = llm.with_structured_output(Tagged, method="function_calling").invoke("Tag it.")
    assert tagged == Tagged(note="}}</tool_call>  # 31", n=tagged.n)
    raw = llm.with_structured_output(Tagged, method="function_calling", include_raw=True).invoke("Tag it.")
    assert raw["parsing_error"] is None and "<tool_call>" not in raw["raw"].content


def test_structured_output_by_json_schema(llm):
    person = llm.with_structured_output(Person, method="json_schema").invoke("A person?")
    assert isinstance(person, Person)


def test_streamed_tool_call_whose_string_holds_the_close_tag(llm):
    """The stream splitter decodes calls structurally too: the streamed call reassembles whole."""
    chunks = list(llm.bind_tools([Tagged], tool_choice="Tagged", parallel_tool_calls=False).stream("Tag it."))
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    call = full.tool_calls[0]
    assert call["name"] == "Tagged" and call["args"]["note"] == "}}</tool_call>  # 31"
    assert "<tool_call>" not in full.content
