"""ReAct agent with tools: the model calls typed Python tools (a calculator, a small fact table) through the
chat template's tool format until it can answer, within a bounded number of steps.

    flowrt run workflows/react_agent.py --input question="What is 17 times 23, plus 4?"

`@fr.tool` makes each function a tool (its JSON schema comes from the signature and docstring). The first
turn must call a tool (`tool_choice="required"`: the call is constrained to the tools' schemas, so it always
parses); later turns may call more (`"auto"`) until the model answers in text, repeats a call, or runs out of
steps; the final answer is then generated with `tool_choice="none"`. The whole episode is one chat thread:
each turn reuses the KV of the turns before it.
"""

import ast
import operator
from typing import Annotated, Literal

from pydantic import Field

import flowrt as fr

FACTS = {"speed of light": "299792 km/s", "boiling point of water": "100 C", "days in a leap year": "366"}

SYSTEM = ("You answer questions. Use the calculator tool for arithmetic and the lookup tool for facts, "
          "then give the final answer in one short sentence.")

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


@fr.tool
def calculator(expression: Annotated[str, Field(description="an arithmetic expression, e.g. 17 * 23 + 4",
                                                 pattern=r"^[-(]*[0-9][-+*/^%(). 0-9]*$", max_length=64)]) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            if isinstance(node.op, ast.Pow) and abs(ev(node.right)) > 100:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only arithmetic is allowed")

    try:
        value = ev(ast.parse(expression.replace("^", "**"), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError) as e:
        return f"error: {e}"
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


@fr.tool
def lookup(topic: Literal["speed of light", "boiling point of water", "days in a leap year"]) -> str:
    """Look up a fact in a small table (the topic's type lists what it knows)."""
    return FACTS.get(topic.strip().lower(), f"no entry for {topic!r}")


TOOLS = [calculator, lookup]

wf = fr.Workflow("react-agent")


@wf.step
async def agent(question: str, llm: fr.Model, max_steps: int = 6) -> dict:
    """Tool-calling turns (at most `max_steps`), then the final answer."""
    c = llm.chat(system=SYSTEM)
    c.user(question)
    actions: list[dict] = []
    seen: set[str] = set()
    answer = None
    c.tools = TOOLS
    if len(llm.encode(c.render(add_generation_prompt=True), first=True)) + 4 * 96 > llm.max_model_len:
        c.tools, max_steps = [], 0  # a tiny context (a test model) cannot hold the tool descriptions: just answer
    for step in range(max_steps):
        reply = await c.assistant(tools=TOOLS, tool_choice="required" if step == 0 else "auto",
                                  parallel_tool_calls=False, max_tokens=96, temperature=0)
        calls = [tc for tc in reply.tool_calls if repr((tc.name, tc.arguments)) not in seen]
        if not reply.tool_calls:
            answer = reply.content.strip() or None  # the model answered in text
            break
        results = await c.call_tools(reply)
        for tc, result in zip(reply.tool_calls, results):
            if repr((tc.name, tc.arguments)) not in seen:
                seen.add(repr((tc.name, tc.arguments)))
                actions.append({"tool": tc.name, "input": tc.arguments, "observation": result})
        if not calls:  # it repeated a call it already made: it has what it needs
            break
    if answer is None:
        # Plain text that does not open another tool call (a small model would rather keep calling).
        final = await c.assistant(tool_choice="none", regex=r"[A-Za-z0-9][^<\n]{0,160}", max_tokens=96,
                                  temperature=0)
        answer = final.strip() or None
    c.close()
    return {"answer": answer, "actions": actions}
