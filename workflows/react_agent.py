"""ReAct agent: the model alternates thoughts and tool calls (a calculator, a small fact table) until it
gives a final answer, within a bounded number of steps.

    flowrt run workflows/react_agent.py --input question="What is 17 times 23, plus 4?"

The whole episode is one thread: each tool result is appended to it, so every step reuses the KV of the
steps before it instead of re-sending the transcript.
"""

import ast
import operator
import re

import flowrt as fr

FACTS = {"speed of light": "299792 km/s", "boiling point of water": "100 C", "days in a leap year": "366"}

FEW_SHOT = """Answer the question. Use tools when needed: calculator[expression] or lookup[topic].

Question: What is 12 times 7?
Thought: I should multiply.
Action: calculator[12 * 7]
Observation: 84
Thought: I know the answer.
Final Answer: 84

Question: How many days are in a leap year, minus 6?
Thought: I need the number of days in a leap year.
Action: lookup[days in a leap year]
Observation: 366
Thought: Now subtract 6.
Action: calculator[366 - 6]
Observation: 360
Thought: I know the answer.
Final Answer: 360

"""

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Arithmetic only (no names, no calls): + - * / // % ** and parentheses."""
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


def lookup(topic: str) -> str:
    return FACTS.get(topic.strip().lower(), f"no entry for {topic!r}")


TOOLS = {"calculator": calculator, "lookup": lookup}

wf = fr.Workflow("react-agent")


@wf.step
async def agent(question: str, llm: fr.Model, max_steps: int = 6) -> dict:
    """Thought / Action / Observation turns until "Final Answer:" (or `max_steps` turns)."""
    t = llm.thread(FEW_SHOT) + f"Question: {question}\nThought:"
    actions = []
    for _ in range(max_steps):
        out = await t.gen(max_tokens=64, temperature=0, stop=["\nObservation:", "\n\n"])
        final = re.search(r"Final Answer:\s*(.+)", out)
        if final:
            return {"answer": final.group(1).strip(), "actions": actions}
        call = re.search(r"Action:\s*(\w+)\[(.*?)\]", out)
        if call is None or t.last_output.outputs[0].stop_reason != "\nObservation:":
            t += "\nThought:"  # no tool call this turn: let the model keep thinking
            continue
        tool, arg = call.group(1), call.group(2)
        observation = TOOLS[tool](arg) if tool in TOOLS else f"unknown tool {tool!r}"
        actions.append({"tool": tool, "input": arg, "observation": observation})
        t += f" {observation}\nThought:"  # the stop string "\nObservation:" is already in the thread
    return {"answer": None, "actions": actions}
