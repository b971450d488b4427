"""Agent frameworks as clients of `flowrt serve` on the default model (SmolLM2-135M-Instruct, float32): the
openai client's responses.create, the OpenAI Agents SDK (its Responses model and OpenAIChatCompletionsModel,
Runner.run and Runner.run_streamed) and a LangGraph ReAct agent with ChatOpenAI (invoke and stream). Each
optional package is skipped when absent; the Agents SDK's tracing is off and it talks only to this server.

The 135M model is weak, so each run is steered the way a small-model deployment would be: the first model call
must call a tool (tool_choice "required"), and a tool is offered until it has been used (the Agents SDK's
`is_enabled`, a LangGraph dynamic model), after which the model answers in text. What is asserted: every tool
call the frameworks ran had arguments their own schemas accept (the tool functions record them), both tools ran
for the question that needs both, and the run ended with a non-empty final answer without call markup. What
the answer says is not asserted beyond that (seeded, it is "10:30 in Paris." today)."""

import asyncio
import json
import os
from typing import Literal

import pytest
from support import serve_model

openai = pytest.importorskip("openai")

SLOW_FIXTURES = {"server"}  # the 135M model behind a server: tests on it are `slow` (tests/conftest.py)
MODEL = "smollm2"
QUESTION = "What is the weather and the time in Paris?"
INSTRUCTIONS = "You answer questions about cities. Use the tools, then answer in one sentence."
City = Literal["Paris", "Rome", "London"]


def weather_of(city: City) -> str:
    return f"It is sunny and 21 C in {city}."


def time_of(city: City) -> str:
    return f"It is 10:30 in {city}."


@pytest.fixture(scope="module")
def server():
    from flowrt.engine import default_model_path

    yield from serve_model(default_model_path(), served_model_name=MODEL)


def _final_answer(text):
    assert isinstance(text, str) and text.strip() and "<tool_call>" not in text, text


def _both_tools_ran(calls):
    assert {name for name, _ in calls} == {"weather", "time"}, calls
    assert all(city in ("Paris", "Rome", "London") for _, city in calls), calls


# ---- the openai client -------------------------------------------------------------------------------------

TOOLS = [{"type": "function", "name": "get_weather", "description": "The current weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                         "required": ["city"]}}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_openai_responses_plain_and_streamed(client):
    r = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=24, temperature=0)
    assert r.output_text.strip() and r.usage.output_tokens >= 1
    with client.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=64, temperature=0) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert final.status == "completed" and "".join(deltas) == final.output_text and final.output_text.strip()


def test_openai_function_call_round_trip_with_previous_response_id(client):
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=TOOLS,
                                    tool_choice="required", parallel_tool_calls=False, temperature=0)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    args = json.loads(call.arguments)
    answer = client.responses.create(model=MODEL, previous_response_id=first.id, tools=TOOLS, tool_choice="none",
                                     temperature=0, max_output_tokens=48,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": weather_of(args["city"])}])
    _final_answer(answer.output_text)
    assert answer.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16


def test_openai_json_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population_millions": {"type": "integer", "minimum": 0,
                                                                       "maximum": 50}},
              "required": ["city", "population_millions"]}
    r = client.responses.create(model=MODEL, input="Describe Paris as JSON.", temperature=0,
                                text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    value = json.loads(r.output_text)
    assert set(value) == {"city", "population_millions"} and 0 <= value["population_millions"] <= 50


# ---- the OpenAI Agents SDK ---------------------------------------------------------------------------------


@pytest.fixture()
def agent_factory(server):
    agents = pytest.importorskip("agents")
    os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"
    agents.set_tracing_disabled(True)
    calls: list[tuple[str, str]] = []

    def unused(name):  # a tool is offered until it has run once, then the model answers
        return lambda ctx, agent: name not in [c[0] for c in calls]

    @agents.function_tool(is_enabled=unused("weather"))
    def get_weather(city: City) -> str:
        """The current weather in a city."""
        calls.append(("weather", city))
        return weather_of(city)

    @agents.function_tool(is_enabled=unused("time"))
    def get_time(city: City) -> str:
        """The local time in a city."""
        calls.append(("time", city))
        return time_of(city)

    def make(kind: str):
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        model = (agents.OpenAIResponsesModel(model=MODEL, openai_client=client) if kind == "responses"
                 else agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client))
        settings = agents.ModelSettings(tool_choice="required", temperature=0.3, max_tokens=128, extra_body={"seed": 0})
        return agents.Agent(name="cities", instructions=INSTRUCTIONS, tools=[get_weather, get_time], model=model,
                            model_settings=settings)

    make.calls = calls
    return make


@pytest.mark.parametrize("kind, chained", [("responses", False), ("responses", True), ("chat_completions", False)])
def test_agents_sdk_runner_run(agent_factory, server, kind, chained):
    """chained: the SDK sends each model call only its new items and the previous response's id."""
    from agents import Runner

    result = asyncio.run(Runner.run(agent_factory(kind), QUESTION, max_turns=5, auto_previous_response_id=chained))
    _both_tools_ran(agent_factory.calls)
    _final_answer(result.final_output)
    if chained:
        last = server.app.state.flowrt_responses.get(result.last_response_id).body
        assert last["previous_response_id"] is not None and last["output"][-1]["type"] == "message"


@pytest.mark.parametrize("kind", ["responses", "chat_completions"])
def test_agents_sdk_runner_run_streamed(agent_factory, kind):
    from agents import Runner

    async def main():
        result = Runner.run_streamed(agent_factory(kind), QUESTION, max_turns=5)
        raw = [e.data.type async for e in result.stream_events() if e.type == "raw_response_event"]
        return result, raw

    result, raw = asyncio.run(main())
    _both_tools_ran(agent_factory.calls)
    _final_answer(result.final_output)
    assert "response.function_call_arguments.delta" in raw and "response.output_text.delta" in raw
    assert raw.count("response.completed") == 2, raw  # the call turn and the answer turn


# ---- LangGraph ---------------------------------------------------------------------------------------------


@pytest.fixture()
def react_agent(server):
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    calls: list[tuple[str, str]] = []

    @tool
    def weather(city: City) -> str:
        """The current weather in a city."""
        calls.append(("weather", city))
        return weather_of(city)

    @tool("time")
    def local_time(city: City) -> str:
        """The local time in a city."""
        calls.append(("time", city))
        return time_of(city)

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL, temperature=0.3, seed=0,
                     max_tokens=128, max_retries=0, timeout=300)

    def model(state, runtime):  # a dynamic model: the tools until they have run, then the answer
        used = {m.name for m in state["messages"] if isinstance(m, ToolMessage)}
        left = [t for t in (weather, local_time) if t.name not in used]
        return llm.bind_tools(left, tool_choice="required") if left else llm

    agent = create_react_agent(model, [weather, local_time], prompt=INSTRUCTIONS)
    agent.calls = calls
    return agent


def test_langgraph_react_agent_invoke(react_agent):
    result = react_agent.invoke({"messages": [("user", QUESTION)]})
    _both_tools_ran(react_agent.calls)
    assert result["messages"][-1].type == "ai" and not result["messages"][-1].tool_calls
    _final_answer(result["messages"][-1].content)


def test_langgraph_react_agent_stream(react_agent):
    steps = list(react_agent.stream({"messages": [("user", QUESTION)]}, stream_mode="updates"))
    _both_tools_ran(react_agent.calls)
    last = steps[-1]["agent"]["messages"][-1]
    assert not last.tool_calls
    _final_answer(last.content)
    assert sum("tools" in s for s in steps) >= 1
