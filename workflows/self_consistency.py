r"""Self-consistency: sample several reasoning paths for one question, then vote on their final answers.

    flowrt run workflows/self_consistency.py \
        --input question="Tom has 3 apples and buys 5 more. How many apples does he have?"

The few-shot prompt and the question are computed once; the samples fork from them copy-on-write, and
run as one batch in the engine. On a small model the vote comes out right because each sample ends at its
"The answer is N." (the few-shot answers' form, and the stop strings), which `final_answer` reads, and the
temperature is 0.5, not 0.8 (the README's "Workflows" section has the numbers). The README shows this file.
"""

import re
from collections import Counter

import flowrt as fr

FEW_SHOT = """Answer the question. Think step by step, then finish with "The answer is N."

Q: There are 3 cars in the parking lot and 2 more cars arrive. How many cars are in the parking lot?
A: There are 3 cars. 2 more arrive, so there are 3 + 2 = 5 cars. The answer is 5.

Q: Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left?
A: They had 32 + 42 = 74 pieces. They ate 35, so 74 - 35 = 39 are left. The answer is 39.

Q: Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many did he give to Denny?
A: Jason had 20 and now has 12, so he gave away 20 - 12 = 8. The answer is 8.

"""

wf = fr.Workflow("self-consistency")


@wf.step
async def solve(question: str, llm: fr.Model, samples: int = 8, max_tokens: int = 96) -> list[str]:
    """Sample `samples` reasoning paths that share the prompt's KV cache."""
    t = llm.thread(FEW_SHOT) + f"Q: {question}\nA:"   # the prompt is computed once ...
    forks = t.fork(samples)                           # ... and shared, copy-on-write, by every fork
    # A seed per sample: the same samples every run. The stop strings end a sample after its answer.
    return await fr.gather(*(f.gen(max_tokens=max_tokens, temperature=0.5, top_p=0.95, seed=i, stop=["\n\n", "\nQ:"])
                             for i, f in enumerate(forks)))


def final_answer(text: str) -> str | None:
    """The number after "The answer is", else the last number in the text."""
    m = re.search(r"answer is\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)", text, re.IGNORECASE)
    numbers = [m.group(1)] if m else re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


@wf.step
def vote(solve: list[str]) -> str:
    """The most common final answer (ties: the one seen first)."""
    counts = Counter(a for a in map(final_answer, solve) if a is not None)
    return counts.most_common(1)[0][0] if counts else "no answer"


if __name__ == "__main__":
    result = wf.run(question="Tom has 3 apples and buys 5 more. How many apples does he have?")
    print(result.output, [final_answer(s) for s in result.outputs["solve"]])
