r"""Tree of thoughts: grow candidate reasoning steps, judge each with `select`, keep the best, repeat.

    flowrt run workflows/tree_of_thought.py \
        --input problem="A farmer has 17 sheep. All but 9 run away. How many are left?"

Each level forks every kept path `breadth` ways (the paths share their KV copy-on-write), samples one more
step on every branch at once, then asks the model to judge each branch by likelihood (`select` scores the
options "sure" / "maybe" / "impossible" on a fork of the branch) and keeps the `beam` best.
"""

import flowrt as fr

PROMPT = """Solve the problem in short steps, one per line. Then give the answer.

Problem: {problem}
"""
JUDGE = "\nIs the reasoning so far correct and helpful? Answer with sure, maybe or impossible:"
VERDICTS = {" sure": 2, " maybe": 1, " impossible": 0}

wf = fr.Workflow("tree-of-thought")


@wf.step
async def search(problem: str, llm: fr.Model, breadth: int = 3, depth: int = 3, beam: int = 2) -> list[str]:
    """Beam search over reasoning steps; returns the best path, one step per item."""
    root = llm.thread(PROMPT.format(problem=problem))
    frontier = [(root, [])]
    for level in range(1, depth + 1):
        branches = [(b, path) for node, path in frontier for b in node.fork(breadth)]
        for b, _ in branches:
            b += f"Step {level}:"
        steps = await fr.gather(*(b.gen(max_tokens=40, temperature=0.9, seed=i, stop="\n")
                                  for i, (b, _) in enumerate(branches)))

        async def judge(b: fr.Thread) -> int:
            with b + JUDGE as j:  # a throwaway fork: the branch itself does not see the question
                return VERDICTS[await j.select(list(VERDICTS))]

        scores = await fr.gather(*(judge(b) for b, _ in branches))
        ranked = sorted(zip(scores, range(len(branches))), key=lambda s: -s[0])  # stable: ties keep order
        keep = {i for _, i in ranked[:beam]}
        for node, _ in frontier:
            node.close()
        for i, (b, _) in enumerate(branches):
            if i not in keep:
                b.close()
        frontier = [(branches[i][0], branches[i][1] + [steps[i].strip()]) for _, i in ranked[:beam]]
    best, path = frontier[0]
    for node, _ in frontier:
        node.close()
    return path


@wf.step
async def answer(problem: str, search: list[str], llm: fr.Model) -> str:
    """The final answer, written after the best path."""
    t = llm.thread(PROMPT.format(problem=problem))
    for i, s in enumerate(search, 1):
        t += f"Step {i}: {s}\n"
    t += "Answer:"
    return (await t.gen(max_tokens=32, temperature=0, stop="\n")).strip()
