"""Structured extraction: pull typed records out of free text into a pydantic list.

    flowrt run workflows/extract.py --input text="Apples cost 3 dollars, bread is 2.50 and milk 1.20."
    flowrt run workflows/extract.py              # extracts from a built-in sample text

`c.assistant(json=Extraction)` constrains the reply to the JSON schema of the pydantic model (engine-side,
token by token) and returns a validated `Extraction` instance: even a small model's output always parses.
Bounds in the schema (string lengths, list size) keep a weak model from rambling.
"""

from typing import Annotated

from pydantic import BaseModel, Field

import flowrt as fr

SAMPLE = "At the market, apples cost 3 dollars, a loaf of bread costs 2.50 dollars and milk is 1.20 dollars."

SYSTEM = "You extract data from text. Reply with JSON only."


class Record(BaseModel):
    """One item mentioned in the text."""

    name: Annotated[str, Field(description="the item, as the text names it", min_length=1, max_length=40)]
    price: Annotated[float, Field(description="its price as a number", ge=0, le=1_000_000)]


class Extraction(BaseModel):
    records: Annotated[list[Record], Field(min_length=1, max_length=12)]


wf = fr.Workflow("extract")


@wf.step
async def extract(llm: fr.Model, text: str = SAMPLE, max_tokens: int = 256) -> list[dict]:
    """Every item and its price, as records validated by `Record`."""
    c = llm.chat(system=SYSTEM)
    c.user(f"List every item and its price in this text.\n\nText: {text}")
    result = await c.assistant(json=Extraction, max_tokens=max_tokens, temperature=0)
    c.close()
    return [r.model_dump() for r in result.records]


@wf.step
def total(extract: list[dict]) -> dict:
    """How many records, and the sum of their prices."""
    return {"records": len(extract), "total": round(sum(r["price"] for r in extract), 2)}
