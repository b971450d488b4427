"""Skeleton of thought: write a short outline, then expand every point in parallel.

    flowrt run workflows/skeleton_of_thought.py --input question="How do I make good coffee at home?"

Every expansion's prompt starts with the same rendered chat text (system prompt, question), so the prefix
cache computes those blocks once and the parallel expansions reuse them.
"""

import re

import flowrt as fr

wf = fr.Workflow("skeleton-of-thought")


@wf.step
async def outline(question: str, llm: fr.Model, points: int = 4) -> list[str]:
    """A numbered outline of at most `points` short points."""
    c = llm.chat()
    c.user(f"Give a short outline, {points} points of a few words each, one per line, numbered, for: {question}")
    text = await c.assistant(max_tokens=20 * points, temperature=0)
    items = [m.strip(" :") for m in re.split(r"(?:^|\s)\d+[.)]\s+", text) if m.strip(" :")]
    return [i for i in items if i][:points] or [text.strip()]


@wf.step(map="outline")
async def expand(outline: str, question: str, llm: fr.Model) -> str:
    """One or two sentences on one point (runs for every point at once)."""
    c = llm.chat()
    c.user(f"Question: {question}\nExpand this point of the answer in one or two sentences: {outline}")
    return (await c.assistant(max_tokens=64, temperature=0)).strip()


@wf.step
def answer(outline: list[str], expand: list[str]) -> str:
    return "\n".join(f"{i}. {p}: {e}" for i, (p, e) in enumerate(zip(outline, expand), 1))
