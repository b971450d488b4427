"""RAG question answering: retrieve chunks from an index, then answer citing their sources.

    flowrt index build workflows/corpus -o corpus-index
    flowrt run workflows/rag_qa.py --index corpus-index --input question="How are KV blocks shared between forks?"

`fr.rag` renders the retrieved chunks in a stable order (by source and position, not by score), each
labelled with its source, and puts the question last. Questions that retrieve overlapping documents
therefore produce prompts with a long common prefix, which the engine's prefix cache computes once.
"""

import flowrt as fr
from flowrt.retrieval import cited_sources

SYSTEM = "You answer questions about the flowrt project from the sources you are given. Be brief and cite sources."
TEMPLATE = (
    "Read these documents about flowrt.\n\n{context}\n\nQuestion: {question}\n"
    "Answer in one or two sentences and end with the name of the document you used in square brackets."
)

wf = fr.Workflow("rag-qa")


@wf.step
async def retrieve(question: str, retriever: fr.Retriever, k: int = 4) -> list:
    """The k chunks closest to the question (searched in a worker thread)."""
    return await retriever.search(question, k=k)


@wf.step
async def answer(question: str, retrieve: list, llm: fr.Model, max_tokens: int = 200) -> dict:
    """Answer from the retrieved chunks; report which sources the generated answer cites (not ones it copied
    from the prompt)."""

    def prompt_tokens(user_text: str) -> int:  # the whole chat rendering, as the engine will see it
        probe = llm.chat(system=SYSTEM).user(user_text)
        return len(llm.encode(probe.render(add_generation_prompt=True), first=True))

    # Fit the model's context: the weakest chunks are dropped first (the rest keep their stable order).
    budget = llm.max_model_len - max_tokens
    prompt = fr.rag(retrieve, question, TEMPLATE, max_tokens=budget, count_tokens=prompt_tokens)
    with llm.chat(system=SYSTEM) as chat:
        chat.user(prompt)
        text = await chat.assistant(max_tokens=max_tokens, temperature=0.0)
    retrieved = sorted({c.source for c in retrieve})
    cited = cited_sources(text, retrieved, prompt)
    return {"answer": text.strip(), "cited": cited, "retrieved": retrieved}
