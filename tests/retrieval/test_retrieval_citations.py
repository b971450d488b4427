"""Citation extraction for RAG answers: only what the generated answer names counts (issue 11, item 13)."""

from __future__ import annotations

from flowrt.retrieval import Chunk, cited_sources, rag

RETRIEVED = ["copy_on_write.md", "kv_cache.md", "rag_qa_example.md"]
CHUNKS = [
    Chunk(text="A forked child shares its parent's blocks; the first write copies a partly filled block.",
          source="copy_on_write.md", position=0, heading="Copy-on-write"),
    Chunk(text="Each layer has one pool of blocks.", source="kv_cache.md", position=0, heading="KV cache"),
    Chunk(text="Its answer step generates an answer that cites sources such as [copy_on_write.md].",
          source="rag_qa_example.md", position=0, heading="The RAG example"),
]
PROMPT = rag(CHUNKS, "How are KV blocks shared between forks?")


def test_bracketed_sources_the_answer_writes_are_cited():
    answer = "Forks share blocks and copy a partly filled block on the first write [copy_on_write.md]."
    assert cited_sources(answer, RETRIEVED, PROMPT) == ["copy_on_write.md"]
    # On a line of its own (what the workflow's template asks for), several in one pair, unknown names ignored.
    assert cited_sources("Blocks are pooled per layer.\n[kv_cache.md]", RETRIEVED, PROMPT) == ["kv_cache.md"]
    assert cited_sources("See [kv_cache.md; copy_on_write.md] and [nowhere.md].", RETRIEVED, PROMPT) == [
        "copy_on_write.md", "kv_cache.md"]


def test_brackets_copied_from_the_prompt_are_not_cited():
    # The model echoes a chunk label and a document sentence that itself mentions a source: no citation.
    echo = ("[copy_on_write.md] Copy-on-write\nA forked child shares its parent's blocks.\n"
            "Its answer step generates an answer that cites sources such as [copy_on_write.md].")
    assert cited_sources(echo, RETRIEVED, PROMPT) == []
    # Its own citation after the echo still counts.
    assert cited_sources(echo + "\nSo blocks are shared [kv_cache.md].", RETRIEVED, PROMPT) == ["kv_cache.md"]
    # A bare citation is never taken for an echo, though "[kv_cache.md]" appears in the prompt.
    assert cited_sources("[kv_cache.md]", RETRIEVED, PROMPT) == ["kv_cache.md"]
    # Without the prompt there is nothing to compare with: every known bracket counts.
    assert cited_sources(echo, RETRIEVED) == ["copy_on_write.md"]
