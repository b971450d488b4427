"""Map-reduce summarization: split a document into chunks, summarize them in parallel, then combine.

    flowrt run workflows/map_reduce.py --input-file text=README.md
    flowrt run workflows/map_reduce.py              # summarizes a built-in sample text
"""

import flowrt as fr

SAMPLE = """\
Large language model programs rarely make one call. An agent plans, calls tools and reflects; a RAG
pipeline retrieves documents and asks several questions about them; self-consistency samples many
answers to the same prompt. These calls share most of their prompt text.

A runtime that keeps the model in the same process can compute the shared text once. The key-value
cache of the shared prefix lives in fixed-size blocks, and every branch of the program points at the
same physical blocks. Only when a branch writes into a shared, partly filled block is that block copied.

The result is less prefill work and more requests in flight: the engine batches the branches of a
program, and the branches of many programs, into the same forward passes.
"""


wf = fr.Workflow("map-reduce")


@wf.step
def chunks(text: str = SAMPLE, words_per_chunk: int = 80) -> list[str]:
    """Paragraph-aligned chunks of about `words_per_chunk` words."""
    out, cur = [], []
    for para in [p.strip() for p in text.split("\n\n") if p.strip()]:
        if cur and len(" ".join(cur + [para]).split()) > words_per_chunk:
            out.append("\n\n".join(cur))
            cur = []
        cur.append(para)
    if cur:
        out.append("\n\n".join(cur))
    return out


async def summary(llm: fr.Model, text: str, max_tokens: int) -> str:
    c = llm.chat()
    c.user(f"Summarize in one sentence:\n\n{text}")
    return (await c.assistant(max_tokens=max_tokens, temperature=0)).strip()


@wf.step(map="chunks", max_concurrency=16)
async def summarize(chunks: str, llm: fr.Model) -> str:
    return await summary(llm, chunks, 48)


@wf.step
async def combine(summarize: list[str], llm: fr.Model) -> str:
    return await summary(llm, " ".join(summarize), 64)
