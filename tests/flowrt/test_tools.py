"""Tools on chat threads (flowrt/llm/tools.py): @fr.tool schemas from signatures and docstrings,
c.assistant(tools=..., tool_choice=...) on the default model (SmolLM2-135M-Instruct), c.call_tools, and the
tool-using example workflows (react_agent, extract) end to end on the default model."""

from __future__ import annotations

import json
import time
from typing import Annotated, Literal, Optional

import anyio
import pytest
from pydantic import BaseModel, Field

import flowrt as fr
from flowrt.llm.toolcalls import ToolCall
from support import ROOT, leak_checked_model

pytest.importorskip("flowrt.engine")



@fr.tool
def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


@fr.tool
async def lookup(topic: Annotated[str, Field(description="what to look up", max_length=30)]) -> str:
    """Look up a fact."""
    return {"pi": "3.14159"}.get(topic.strip().lower(), "unknown")


# ------------------------------------------------------------------------------------------ no model
def test_tool_schema_from_signature_and_docstring():
    @fr.tool
    def search(query: str, limit: int = 5, lang: Optional[str] = None, mode: Literal["fast", "full"] = "fast",
               tags: list[str] = [],  # noqa: B006
               weight: Annotated[float, Field(description="ranking weight", ge=0)] = 1.0) -> list[str]:
        """Search the index
        for documents.

        More detail that is not part of the description.

        Args:
            query: the words to find
            limit: how many results
                at most (a continued line)
        """
        return [query] * limit

    assert isinstance(search, fr.Tool) and search.name == "search"
    assert search.description == "Search the index for documents."
    p = search.parameters
    assert p["type"] == "object" and p["required"] == ["query"] and p["additionalProperties"] is False
    props = p["properties"]
    assert props["query"] == {"type": "string", "description": "the words to find"}
    assert props["limit"]["type"] == "integer" and props["limit"]["default"] == 5
    assert props["limit"]["description"] == "how many results at most (a continued line)"
    assert {"type": "null"} in props["lang"]["anyOf"] and props["lang"]["default"] is None
    assert props["mode"]["enum"] == ["fast", "full"]
    assert props["tags"]["type"] == "array" and props["tags"]["items"] == {"type": "string"}
    assert props["weight"]["description"] == "ranking weight" and props["weight"]["minimum"] == 0
    assert "title" not in p and all("title" not in v for v in props.values())
    assert search("x", 2) == ["x", "x"]  # still the function
    oa = search.to_openai()
    assert oa["type"] == "function" and oa["function"]["name"] == "search" and oa["function"]["parameters"] == p
    assert add.parameters["properties"]["a"] == {"type": "integer", "description": "the first number"}
    assert lookup.is_async and not add.is_async and lookup.description == "Look up a fact."

    named = fr.tool(name="plus", description="Adds.")(lambda a, b: a + b)
    assert named.name == "plus" and named.description == "Adds." and named.parameters["required"] == ["a", "b"]


def test_tool_invoke_validates_arguments():
    async def main():
        return await add.invoke({"a": "2", "b": 3}), await lookup.invoke({"topic": "PI"})

    assert anyio.run(main) == (5, "3.14159")
    with pytest.raises(ValueError):
        add.validate({"a": "two"})
    with pytest.raises(ValueError):
        add.validate({"a": 1, "c": 2})  # unknown argument


# ------------------------------------------------------------------------------------------ default model
SLOW_FIXTURES = {"engine"}  # the 135M model: tests on it are `slow` (tests/conftest.py)


@pytest.fixture(scope="module")
def engine():
    from flowrt.engine import AsyncLLM

    # dequantized (quantization=None), as these tests' expected answers were found: kept quantized (the default
    # since issue 33) the int8 activations flip near-ties, and the agent's final answer changes wording
    eng = AsyncLLM(model=None, dtype="float32", seed=0, num_kv_blocks=1024, quantization=None)
    yield eng
    eng.shutdown()


@pytest.fixture()
def llm(engine):
    yield from leak_checked_model(engine)


def test_call_tools_runs_sync_and_async_tools_concurrently(llm):
    @fr.tool
    def slow_sync(x: int) -> int:
        """Sleeps in a thread."""
        time.sleep(0.6)
        return x * 2

    @fr.tool
    async def slow_async(x: int) -> dict:
        """Sleeps on the loop."""
        await anyio.sleep(0.6)
        return {"x": x}

    calls = [ToolCall("c1", "slow_sync", {"x": 2}), ToolCall("c2", "slow_async", {"x": 3}),
             ToolCall("c3", "slow_sync", {"x": 4}), ToolCall("c4", "slow_sync", {"x": "not a number"}),
             ToolCall("c5", "nope", {})]
    reply = fr.AssistantReply("...", "", calls)

    async def main():
        with llm.chat() as c:
            c.user("hi")
            c.tools = [slow_sync, slow_async]
            t0 = time.perf_counter()
            results = await c.call_tools(reply)
            return results, time.perf_counter() - t0, c.messages

    results, elapsed, messages = anyio.run(main)
    assert elapsed < 1.1, elapsed  # three 0.6 s tools ran at once
    assert results[:3] == ["4", json.dumps({"x": 3}), "8"]
    assert results[3].startswith("error: invalid arguments for slow_sync") and "x" in results[3]
    assert results[4].startswith("error: unknown tool 'nope'")
    tool_msgs = messages[-5:]
    assert [m["role"] for m in tool_msgs] == ["tool"] * 5
    assert [m["tool_call_id"] for m in tool_msgs] == ["c1", "c2", "c3", "c4", "c5"]
    assert [m["content"] for m in tool_msgs] == results


def test_assistant_required_yields_parseable_calls_and_a_turn_loop(llm):
    async def main():
        with llm.chat(system="You are a helpful assistant.") as c:
            c.user("What is 19 plus 23?")
            reply = await c.assistant(tools=[add, lookup], tool_choice="required", parallel_tool_calls=False,
                                      temperature=0)
            assistant_msg = dict(c.messages[-1])
            results = await c.call_tools(reply)
            final = await c.assistant(tool_choice="none", max_tokens=24, temperature=0)
            named = await c.fork(1)[0].assistant(tool_choice="lookup", parallel_tool_calls=False, max_tokens=64,
                                                 temperature=0.7, seed=1)
            return reply, assistant_msg, results, final, named, llm.counters["chat_rerenders"], c.messages

    reply, msg, results, final, named, rerenders, messages = anyio.run(main)
    assert isinstance(reply, str) and isinstance(reply, fr.AssistantReply)
    assert len(reply.tool_calls) == 1 and reply.content == ""
    call = reply.tool_calls[0]
    assert call.name in ("add", "lookup") and isinstance(call.arguments, dict) and call.id
    {"add": add, "lookup": lookup}[call.name].validate(call.arguments)  # valid by construction
    assert msg["tool_calls"][0]["function"] == {"name": call.name, "arguments": call.arguments}
    assert messages[3] == {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": results[0]}
    assert final.tool_calls == [] and "<tool_call>" not in final
    assert named.tool_calls and all(tc.name == "lookup" for tc in named.tool_calls)
    assert rerenders == 0  # the tool-call turn re-renders byte for byte: every turn reused the KV before it


def test_tool_choice_none_and_auto(llm):
    async def main():
        with llm.chat() as c:
            c.user("Say hello.")
            none = await c.assistant(tools=[add], tool_choice="none", max_tokens=16, temperature=0)
            c.user("Add 2 and 2 with the add tool.")
            auto = await c.assistant(max_tokens=64, temperature=0)  # tools stay with the chat: "auto"
            return none, auto

    none, auto = anyio.run(main)
    assert none.tool_calls == [] and "<tool_call>" not in none
    assert isinstance(auto, fr.AssistantReply)
    for tc in auto.tool_calls:  # a call the model starts is constrained: it parses and validates
        assert tc.name == "add"
        add.validate(tc.arguments)
    with pytest.raises(ValueError, match="tool_choice"):
        anyio.run(lambda: llm.chat().assistant(tools=[add], tool_choice="bogus"))


def test_gen_json_model_on_default_model(llm):
    class City(BaseModel):
        name: Annotated[str, Field(max_length=20)]
        country: Annotated[str, Field(max_length=20)]
        population_millions: Annotated[int, Field(ge=0, le=50)]

    async def main():
        with llm.chat() as c:
            c.user("Describe Paris as JSON with name, country and population_millions.")
            return await c.assistant(json=City, temperature=0)

    city = anyio.run(main)
    assert isinstance(city, City) and city.name


def test_react_agent_answers_with_tools_on_default_model(engine):
    from flowrt.graph.loader import load_workflow

    wf = load_workflow(ROOT / "workflows" / "react_agent.py")

    async def main():
        async with fr.Runtime(engine) as rt:
            return await rt.run(wf, question="What is 17 times 23, plus 4?")

    r = anyio.run(main)
    assert r.ok, {k: e.traceback for k, e in r.errors.items()}
    out = r.outputs["agent"]
    assert out["actions"] and out["actions"][0]["tool"] == "calculator"
    assert out["actions"][0]["observation"] == "395"
    assert "395" in out["answer"]


def test_extract_workflow_on_default_model(engine):
    from flowrt.graph.loader import load_workflow

    wf = load_workflow(ROOT / "workflows" / "extract.py")

    async def main():
        async with fr.Runtime(engine) as rt:
            return await rt.run(wf, text="Apples cost 3 dollars and milk costs 1.20 dollars.")

    r = anyio.run(main)
    assert r.ok, {k: e.traceback for k, e in r.errors.items()}
    records = r.outputs["extract"]
    assert records and all(set(rec) == {"name", "price"} for rec in records)
    assert any("milk" in rec["name"].lower() for rec in records)
    assert r.output["records"] == len(records)


def test_readme_structured_and_tools_block_runs(tmp_path, engine):
    import re

    from flowrt.graph.loader import load_workflow

    text = (ROOT / "README.md").read_text()
    start = text.index("### Structured output and tools")
    src = re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)
    path = tmp_path / "structured.py"
    path.write_text(src)
    wf = load_workflow(path)

    async def main():
        async with fr.Runtime(engine) as rt:
            return await rt.run(wf)

    r = anyio.run(main)
    assert r.ok, {k: e.traceback for k, e in r.errors.items()}
    out = r.output
    assert set(out["city"]) == {"name", "country"}
    assert len(out["calls"]) == 1 and out["calls"][0][0] == "population"
    assert len(out["results"]) == 1 and isinstance(out["answer"], str)


def test_render_uses_the_templates_tools_or_a_hermes_system_prompt(llm):
    tools_template = ("{% for t in tools %}TOOL {{ t['function']['name'] }}\n{% endfor %}"
                      "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                      "{% for c in m.get('tool_calls', []) %} CALL {{ c['function']['name'] }}{% endfor %}\n"
                      "{% endfor %}")
    call = ToolCall("c1", "add", {"a": 1, "b": 2})
    with llm.chat(chat_template=tools_template) as c:
        c.user("hi")
        c.tools = [add]
        c.messages.append({"role": "assistant", "content": "",
                           "tool_calls": [{"id": "c1", "type": "function",
                                           "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]})
        text = c.render()  # the template's own tool rendering, given tools= and the tool_calls as they are
        assert text.startswith("TOOL add") and "CALL add" in text and "<tool_call>" not in text
    with llm.chat(system="Be brief.") as c:  # SmolLM2's template ignores tools=: Hermes-style system prompt
        c.user("hi")
        c.tools = [add]
        from flowrt.llm.tools import assistant_message

        c.messages.append(assistant_message(fr.AssistantReply(call.to_text(), "", [call])))
        text = c.render()
        assert "Be brief.\n\nYou may call one or more functions" in text and '"name": "add"' in text
        assert "<|im_start|>assistant\n" + call.to_text() + "<|im_end|>" in text
